package engine

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// Direct grants for the reentrant lock (internal/scripts/lock_lib.lua).
//
// A waiter that waits in another process than the lock's holder costs, without
// them, the release, the unlock message and an attempt of its own: a round trip
// and a wake-up after the release, and when ten processes wait, ten attempts
// racing for each release. With them, a queued waiter's refused attempt registers
// it in Redis (its first attempt does not: most find the lock free), one
// registration per client and lock, and the release that frees
// the lock gives it to the oldest registered waiter of another client in the same
// script call, and tells that client on its grant channel. The waiter needs no
// call of its own: a handoff to another process costs the release alone.
//
// The grant goes to a field made for that waiter alone (grantFieldOf), not to its
// handle's field. So it can never mix with anything the handle does meanwhile (a
// TryLock, a give-back, a cleanup of a lost hold): a grant that nobody takes is
// given back by its field (giveBackGrant), and the hold the waiter gets keeps that
// field until its last Unlock (hold.field; re-entries use it too).
//
// The grant is dated, safely early, at the send time of the attempt that
// registered the waiter: the registration carries that moment (a stamp, micros
// since machine.epoch) and the grant message echoes it. A registered waiter retries
// at least every third of its lease, so the stamp is never older than that.
//
// A message can be lost (a reconnect) or overtaken by the waiter's next attempt:
// every registering attempt also names the waiter's grant field, and claims a grant
// it finds there (lock_acquire's reply -3) rather than waiting behind it; the
// message that comes after such a claim is void (noteClaimed).
//
// Redisson clients never register; a release publishes the unlock message instead
// of granting while any other listener on the channel is not a registered leash
// client (lock_lib.lua), so a Java waiter is never starved.

// grantOwnerBit marks the owner numbers of grant fields: handle owner ids count
// up from 1 and never reach it.
const grantOwnerBit = uint64(1) << 63

// grantSep separates the fields of a grant message, "<waiter id>|<stamp>|<lock>",
// and of a registration (see registration).
const grantSep = "|"

// grantFieldOf returns the field direct grants to waiter id are made to.
func (m *machine) grantFieldOf(id uint64) string {
	return ownerField(m.cfg.clientID, grantOwnerBit|id)
}

// stamp returns t as micros since m.epoch, for a registration.
func (m *machine) stamp(t time.Time) string {
	if m.epoch.IsZero() {
		m.epoch = t
	}
	return strconv.FormatInt(max(t.Sub(m.epoch).Microseconds(), 0), 10)
}

// registration returns w's registration for lock_acquire and lock_handoff,
// "<lease ms>|<stamp>|<waiter id>|<grant field>", or "" when w may not register:
// only a plain lock's queued waiters do, once this client listens on its grant
// channel (a registration of a client that does not listen counts as dead) and
// on the lock's unlock channel.
func (m *machine) registration(w *waiter, now time.Time) string {
	if w.lock.fair != nil || w.direct || w.oneShot || m.closing {
		return ""
	}
	if m.grantSub != subSubscribed {
		m.subscribeGrants()
		return ""
	}
	if w.lock.sub != subSubscribed {
		// lock_lib.lua counts a registered client as a listener on the unlock
		// channel: registered before its subscription is made (or after one
		// failed), this client would hide a Redisson waiter there from a release,
		// which would grant to it rather than publish. onSubscribed wakes the
		// head, which registers then.
		return ""
	}
	w.lock.mayBeRegistered = true
	return millis(m.leaseOf(w.lease)) + grantSep + m.stamp(now) + grantSep +
		strconv.FormatUint(w.id, 10) + grantSep + m.grantFieldOf(w.id)
}

// attemptArgs returns the KEYS and ARGV of w's lock_acquire. A waiter's first
// attempt does not register (most find the lock free: an uncontended Lock stays
// one key and two arguments, and no registration to drop); once refused, its
// attempts register, and claim a grant to it not yet heard of. The first
// attempt subscribes the grant channel, so it is there by the second.
func (m *machine) attemptArgs(w *waiter, field string, now time.Time) ([]string, []string) {
	l := w.lock
	args := []string{m.leaseText(w.lease), field}
	if !w.refused && !w.registered {
		if m.grantSub == subNone && !w.direct && !w.oneShot && !m.closing {
			m.subscribeGrants()
		}
		return l.nameKeys[:1], args
	}
	if reg := m.registration(w, now); reg != "" {
		return l.nameKeys, append(args, m.cfg.clientID, reg, m.grantFieldOf(w.id))
	}
	return l.nameKeys[:1], args
}

// subscribeGrants subscribes this client's grant channel, once for its life.
func (m *machine) subscribeGrants() {
	if m.grantSub != subNone {
		return
	}
	m.grantSub = subSubscribing
	m.stats.Subscribes++
	m.fx.subs = append(m.fx.subs, subOp{channel: m.grantChannel})
}

// onGrantsSubscribed: the grant channel's subscription is confirmed (or failed,
// and the next registering attempt tries again).
func (m *machine) onGrantsSubscribed(err error, now time.Time) {
	if err != nil {
		m.grantSub = subNone
		return
	}
	m.grantSub = subSubscribed
	if m.closing {
		m.unsubscribeGrants()
		return
	}
	// Heads refused before now did not register: they attempt again, and do. A lock
	// whose own subscription is still to come is left alone: that wakes its head.
	for _, l := range m.locks {
		if l.fair == nil && l.sub == subSubscribed && (l.parked || l.attempting != nil) &&
			l.queue.head != nil && !l.queue.head.registered {
			m.wakeHead(l, now)
		}
	}
}

// unsubscribeGrants drops the grant channel when the client closes, and Close
// waits for that (its unsubscribeDone counts as I/O in flight). While this client
// listens there, other clients' releases count its registrations as live and
// grant to them; a grant whose message came after the engine had stopped would
// hold the lock for nobody until its lease ended (a test that closes a client
// mid-contention saw the other client stall for the lease, 2 runs in 288 with
// 16 in parallel). Once the channel is dropped, lock_lib.lua counts this client's
// registrations as dead; a grant made before that is heard before the
// unsubscription's reply (one connection, in order), and given back
// (onGrantMessage) before Close ends.
func (m *machine) unsubscribeGrants() {
	if m.grantSub != subSubscribed {
		return // subscribing: onGrantsSubscribed does it once confirmed
	}
	m.grantSub = subUnsubscribing
	m.fx.subs = append(m.fx.subs, subOp{channel: m.grantChannel, unsubscribe: true})
}

// selfListens is lock_release's and lock_handoff's "1" when this client listens on
// l's unlock channel, so the scripts count only the other listeners.
func selfListens(l *lockState) string {
	if l.sub == subSubscribed {
		return "1"
	}
	return "0"
}

// onGrantMessage takes a direct grant's message: the registered waiter gets the
// lock, dated at its registration's stamp. A waiter whose attempt is in flight
// takes it when that attempt's reply says the lock is refused (the attempt may
// also claim it). A grant nobody can take (the waiter left, or its handle holds
// the lock or has a call in flight, which a hold under a second field would
// confuse) is given back, and the waiter, if any, retries on the unlock message
// the give-back publishes.
func (m *machine) onGrantMessage(payload string, now time.Time) {
	idText, rest, ok1 := strings.Cut(payload, grantSep)
	stampText, name, ok2 := strings.Cut(rest, grantSep)
	id, err1 := strconv.ParseUint(idText, 10, 64)
	stamp, err2 := strconv.ParseInt(stampText, 10, 64)
	if !ok1 || !ok2 || err1 != nil || err2 != nil {
		return
	}
	if _, ok := m.claimedGrants[id]; ok {
		// Its waiter's attempt claimed the grant before this message came; the
		// hold may have been released or handed on since, so the message is void.
		delete(m.claimedGrants, id)
		return
	}
	m.stats.Notices++
	l := m.locks[name]
	if w := m.waiters[id]; w != nil && l != nil && w.lock == l && l.fair == nil && !w.direct && !m.closing {
		if w.attempting {
			w.grantHeard, w.grantStamp = true, stamp
			return
		}
		if m.mayTakeGrant(w, false) {
			m.takeGrant(w, m.epoch.Add(time.Duration(stamp)*time.Microsecond), now)
			m.advance(l, now)
			m.maybeForget(l)
			return
		}
	}
	if l == nil {
		l = m.lockFor(name, false)
	}
	if l.fair == nil {
		m.giveBackGrant(l, id)
	}
	m.maybeForget(l)
}

// mayTakeGrant reports whether w may take a direct grant: its handle holds
// nothing here and has no call (but, with ownAttempt, w's own attempt, whose reply
// is being read: a grant then is as an attempt's) or give-back in flight.
func (m *machine) mayTakeGrant(w *waiter, ownAttempt bool) bool {
	key := holdKey{w.lock.id, w.owner}
	return m.holds[key] == nil && (ownAttempt || !m.ownerBusy(key)) && !m.givingBack(key) &&
		!w.lock.handingOff && w.leaving == 0
}

// onLeaveRegDone: a lock_leave is answered; its waiter, if still there, may
// attempt again.
func (m *machine) onLeaveRegDone(d scriptDone, now time.Time) {
	if w := m.waiters[d.call.waiter]; w != nil && w.leaving > 0 {
		w.leaving--
	}
	if l := m.lockByID[d.call.lock]; l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

// takeGrant grants w the lock under its grant field, dated sentAt.
func (m *machine) takeGrant(w *waiter, sentAt, now time.Time) {
	l := w.lock
	m.stats.DirectGrants++
	w.grantedField = m.grantFieldOf(w.id) // the hold's field (see grant)
	l.chain = 0                           // a grant from elsewhere starts a new chain
	owner := w.owner
	m.grant(w, sentAt, now)
	if h := m.holds[holdKey{l.id, owner}]; h != nil {
		// Dated early for its expiry, but for a force-release's reply it counts as
		// granted when heard of (see onForceDone).
		h.grantedAt = now
	}
}

// giveBackGrant gives back a direct grant to waiter id that nobody takes, unless a
// local hold already has its field (the waiter claimed the grant before the
// message came). See leaveRegistration.
func (m *machine) giveBackGrant(l *lockState, id uint64) {
	field := m.grantFieldOf(id)
	for _, h := range l.holders {
		if h.field == field {
			return
		}
	}
	m.stats.GrantsGivenBack++
	m.runLeave(l, id, "")
}

// leaveRegistration runs when registered waiter w is done without a grant: the
// registration goes (if it still names w), and so does a grant to w not yet heard
// of. The next local waiter registers in the same call when it can; otherwise it
// attempts, and registers so.
func (m *machine) leaveRegistration(w *waiter) {
	l := w.lock
	reg := ""
	if n := l.queue.head; n != nil && l.attempting == nil && !l.handingOff {
		if reg = m.registration(n, m.now); reg != "" {
			n.registered = true
		}
	}
	if reg == "" {
		l.parked = false
	} else if n := l.queue.head; l.parked {
		// The new registration's stamp must stay fresh: its waiter's lease, not
		// the previous head's, sets the retry (see park).
		m.park(l, m.leaseOf(n.lease), m.now)
	}
	if reg == "" && l.queue.len == 0 {
		// No local waiter is left: the leave drops whatever registration is this
		// client's, which another waiter's may have replaced, so that none stays
		// for dropRegistration to find.
		l.mayBeRegistered = false
		m.sendLeave(l, w.id, "*", reg)
		return
	}
	m.runLeave(l, w.id, reg)
}

// runLeave runs lock_leave for waiter id, with reg the registration to write in
// its place ("" for none). A waiter that is still there makes no attempt until
// the leave is answered: its attempt could otherwise claim the grant just before
// the leave deletes it (see onLeaveRegDone).
func (m *machine) runLeave(l *lockState, id uint64, reg string) {
	m.sendLeave(l, id, strconv.FormatUint(id, 10), reg)
}

// sendLeave is runLeave with the waiter lock_leave names as registered: id, or
// "*" for any waiter of this client's. The grant given back is id's.
func (m *machine) sendLeave(l *lockState, id uint64, named, reg string) {
	if w := m.waiters[id]; w != nil {
		w.leaving++
	}
	m.run(scriptCall{
		waiter:  id,
		script:  scripts.LockLeave,
		keys:    l.releaseKeys,
		args:    []string{m.cfg.clientID, named, m.grantFieldOf(id), unlockMessage, selfListens(l), reg},
		purpose: purposeAbandon,
		lock:    l.id,
	})
}

// dropRegistration sends a lock_leave for whatever registration of this client's
// may be left on l, whose last waiter is gone: a release that would have dropped
// it failed, a hold ended without one (lost, given back), or a waiter left whose
// registration another had replaced. Like every lock_leave it is sent until it
// runs (retryLeaveLater). It names no waiter ("*") and no grant field (""), so
// it only drops the registration.
func (m *machine) dropRegistration(l *lockState) {
	l.mayBeRegistered = false
	m.run(scriptCall{
		script:  scripts.LockLeave,
		keys:    l.releaseKeys,
		args:    []string{m.cfg.clientID, "*", "", unlockMessage, selfListens(l), ""},
		purpose: purposeAbandon,
		lock:    l.id,
	})
}

// withoutStaleDrop readies a call sent again (retryOnce, onLeaveRetry) that
// drops this client's registration whatever waiter it names: a release's drop
// (lock_release's ARGV[6]) or a "*" leave. When local waiters came since its
// first send, one may be registered now, and the drop would delete that
// registration (its waiter, still listening, would be woken by the unlock
// message instead of granted, until it registered again). The release then goes
// without the drop, a leave that gives back a gone waiter's grant names that
// waiter, and the registration goes with the new waiters' last release or leave.
// It reports false for a leave that only dropped the registration
// (dropRegistration), which is then not sent.
func (m *machine) withoutStaleDrop(call *scriptCall) bool {
	l := m.lockByID[call.lock]
	if l == nil || l.fair != nil || (l.queue.len == 0 && !l.mayBeRegistered) {
		return true
	}
	switch {
	case call.script == scripts.LockRelease && len(call.args) > 5 && call.args[5] == "1":
		call.args = slices.Clone(call.args)
		call.args[5] = "0"
	case call.script == scripts.LockLeave && call.args[1] == "*" && call.waiter == 0:
		l.mayBeRegistered = true
		return false
	case call.script == scripts.LockLeave && call.args[1] == "*":
		call.args = slices.Clone(call.args)
		call.args[1] = strconv.FormatUint(call.waiter, 10)
	default:
		return true
	}
	l.mayBeRegistered = true
	return true
}

// onRegisteredAttempt reads the reply of w's attempt that carried a registration
// (see onAttemptDone): claimed is lock_acquire's -3. It reports whether w took a
// grant.
func (m *machine) onRegisteredAttempt(w *waiter, claimed bool, sentAt, now time.Time) bool {
	heard, stamp := w.grantHeard, w.grantStamp
	w.grantHeard = false
	if claimed && !heard {
		m.noteClaimed(w.id)
	}
	switch {
	case claimed && m.holds[holdKey{w.lock.id, w.owner}] == nil:
		m.takeGrant(w, sentAt, now)
		return true
	case claimed:
		m.giveBackGrant(w.lock, w.id)
		return false
	}
	w.registered = true
	w.lock.registered = true
	if heard && w.cancelErr == nil && !w.expired && m.mayTakeGrant(w, true) {
		m.takeGrant(w, m.epoch.Add(time.Duration(stamp)*time.Microsecond), now)
		return true
	}
	if heard {
		m.giveBackGrant(w.lock, w.id)
	}
	return false
}

// maxClaimedGrants bounds machine.claimedGrants: a message lost to a reconnect
// leaves its entry, which nothing else removes.
const maxClaimedGrants = 4096

// noteClaimed records that waiter id's grant was claimed by its attempt before its
// message came: the message, when it comes, must not give back what may by then be
// a live hold under another owner's name (a handoff of the field in flight) or
// nothing at all. One grant sends one message.
func (m *machine) noteClaimed(id uint64) {
	if len(m.claimedGrants) >= maxClaimedGrants {
		clear(m.claimedGrants) // a stale message then costs a harmless give-back
	}
	m.claimedGrants[id] = struct{}{}
}

// holdField is HoldField's answer.
func (m *machine) holdField(lock string, owner uint64) string {
	l := m.locks[lock]
	if l == nil {
		return ""
	}
	if h := m.holds[holdKey{l.id, owner}]; h != nil {
		return h.field
	}
	return ""
}

// Yielding to unregistered listeners.
//
// A release grants directly only when every other listener on the unlock channel
// is a registered leash client; otherwise it publishes the unlock message, and the
// heads of all listeners race for the lock. A Redisson waiter reacts to that
// message a hop later than a leash head that hears it too (the head's engine sends
// its attempt as the message arrives), and a leash client with local waiters
// chains up to the handoff bound before its next public release. So under steady
// leash contention a Redisson waiter lost nearly every race: in a stress run
// (three clients of three goroutines each, 200 µs holds) a Redisson-style waiter
// lost 25-50 races and waited up to about 1 s for each acquisition, against 13 ms
// at most with one goroutine per client. Leash heads that need not race therefore
// give way for cfg.publicYield (by default one tick of the timing wheel, which may
// fire up to a tick early) before they try:
//
//   - a registered head (one a leash release would grant directly) that hears a
//     public unlock message;
//   - the releasing client's head after its release at the chain bound went public
//     (lock_handoff's reply 1), which would otherwise try first.
//
// A pending yield takes in further messages (its own client's unlock message may
// arrive after the reply) rather than restarting. Any other head that hears a
// message races at once, and an attempt already started goes ahead whatever the
// yield.
//
// The cost, in leash-only contention: registered heads give way for a tick to any
// unregistered listener, which may be a leash client: a waiter refused once and not
// registered yet, or a client lingering on the channel after its last waiter got
// the lock without registering (for Linger, 250 ms by default). And each handoff
// from a Redisson holder to a registered leash waiter waits a tick.

// yieldToPublic makes l's head wait cfg.publicYield before it attempts, and reports
// whether it does (or already did).
func (m *machine) yieldToPublic(l *lockState) bool {
	if m.cfg.publicYield <= 0 || l.fair != nil || l.attempting != nil || l.handingOff || l.queue.head == nil {
		return false
	}
	if m.yieldPending(l) {
		return true
	}
	l.wakePending = false // covered by the attempt after the yield
	l.parked = false      // the message says the lock may be free: if the yield ends otherwise, advance tries
	m.armRetry(l, m.cfg.publicYield)
	l.yieldGen = l.retryGen
	return true
}

// yieldPending reports whether l's head is yielding: its retry timer is still the
// yield's. Anything that re-arms or disarms that timer ends the yield (a timer
// armed for another reason, a lock left without waiters). A pending yield holds
// back only advance's attempts; when its timer fires the head tries (or, with an
// attempt in flight, tries once more if that one is refused).
func (m *machine) yieldPending(l *lockState) bool {
	return l.retryGen != 0 && l.retryGen == l.yieldGen
}
