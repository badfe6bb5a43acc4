package engine

import (
	"strconv"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
)

// The local handoff: an Unlock whose lock has a local waiter releases and grants in
// one lock_handoff call, so the lock is never free in between and no unlock message
// is needed.
//
// The early grant. Below the chain bound, lock_handoff always hands over when the
// releasing owner still holds the lock with a count of 1, which the engine knows it
// does. So the waiter is granted at once, when the Unlock arrives, not when the
// call's reply does: until the reply confirms the swap, the new holder runs under the
// releasing owner's lease, which is still on the key and keeps every other client
// out, and the engine's expiry for it is no later than that lease's. This takes the
// round trip out of every local handoff (the idle gap between one holder's Unlock and
// the next holder's start). A fair lock grants early to the waiter the last
// handoff's reply said heads the Redis queue (lockState.fairRun), and its
// fair_handoff call is then told to hand over whatever it finds, so it is as sure
// to as lock_handoff is.
//
// Until the reply comes back, the receiving owner's calls wait behind the handoff
// (see serial.go): its Unlock or re-entry must reach Redis after the call that gives
// it the lock. Its owner-guarded cleanups (a grant nobody received, a lost or closed
// hold) wait too (see abandon), so none runs before the handoff it cleans up after.
// If the reply says the swap did not happen (the releasing owner's field was gone: a
// force-release; or a transport error twice), the new holder's Lost closes, exactly
// as for a holder whose lock was force-released; a fair lock's receiver also leaves
// the Redis queue then (fairLeaveOwner), where its entry may still be.

// handoffTarget returns the local waiter that h's release may hand the lock to
// directly, or nil.
//
// Why a bound: a direct handoff never frees the lock, so waiters in other processes
// never see a release. Like sync.Mutex's starvation mode, once a chain of local
// handoffs reaches cfg.handoffChain handoffs or cfg.handoffAge, whichever comes
// first, the handoff script releases the lock to everyone instead, if anyone besides
// this client listens on the unlock channel; this process's head then competes with
// the other processes' heads on the same unlock message. When nobody else listens,
// nobody else is waiting to be woken, and the chain goes on; when the chain's last
// handoff said so, the engine does not even ask (noteListeners).
func (m *machine) handoffTarget(l *lockState, h *hold) *waiter {
	if l.handingOff {
		return nil
	}
	return m.localTarget(l, h)
}

// localTarget is handoffTarget whatever the handoff in flight: the relay
// (relay.go) hands on while one is.
func (m *machine) localTarget(l *lockState, h *hold) *waiter {
	m.pruneCancelled(l)
	w := l.queue.head
	if w == nil || h.count != 1 || l.attempting != nil || len(l.holders) != 1 || m.cfg.handoffChain <= 0 {
		return nil
	}
	if m.givingBack(holdKey{l.id, w.owner}) {
		return nil // see giveback.go: a plain release, and its attempt waits
	}
	if q := m.serial[holdKey{l.id, w.owner}]; q != nil && w.owner != h.owner && q.busy > 0 {
		// The waiter's handle has a call in flight (a single try of another
		// goroutine's): the handoff is the waiter's attempt, which waits for it as
		// startAttempt's would. Sent beside it, Redis may run the two in either
		// order, and what the handoff's reply does with the owner's field (a grant
		// nobody receives given back whole) could undo what the other call took.
		return nil
	}
	if l.fair != nil && !w.enqueued {
		// A fair lock hands over only to a waiter in the Redis queue (the script
		// checks it heads it), so FIFO across processes holds without a bound.
		return nil
	}
	return w
}

// chainBound reports whether l's chain of local handoffs has reached its bound.
func (m *machine) chainBound(l *lockState, now time.Time) bool {
	return l.chain > 0 && (l.chain >= m.cfg.handoffChain || now.Sub(l.chainStart) >= m.cfg.handoffAge)
}

// earlyGrantMinLease is the least lease the releasing owner must have left for its
// handoff to grant early: with less, the new holder's Lost could close before the
// reply confirms the swap.
const earlyGrantMinLease = 100 * time.Millisecond

// canGrantEarly reports whether h's handoff to w may grant w before the reply (see
// the top of this file): a plain lock below the chain bound (or past it with the
// check skipped: noteListeners), so the script is sure to hand over, or a fair
// lock whose Redis queue w heads as far as the last reply said (fair_handoff is
// then told to hand over whatever it finds; see its header);
// a receiving owner with nothing in flight and nothing held; enough of h's lease
// left; and no surplus count of h's that the server may hold (maySurplus), which
// would make the script keep the lock and the early grant be lost.
func (m *machine) canGrantEarly(l *lockState, h *hold, w *waiter, bounded bool, now time.Time) bool {
	key := holdKey{l.id, w.owner}
	sure := !bounded
	if l.fair != nil {
		sure = w.enqueued && len(l.fairRun) > 0 && w.id == l.fairRun[0]
	}
	return sure && !h.maySurplus && w.cancelErr == nil && !w.expired &&
		!m.ownerBusy(key) && m.holds[key] == nil &&
		h.expiresAt.Sub(now) >= earlyGrantMinLease+expiryMargin(m.leaseOf(w.lease))
}

func (m *machine) handoff(l *lockState, h *hold, w *waiter, future *futures.Future[error], now time.Time) {
	bounded := m.chainBound(l, now)
	if bounded && l.fair == nil && !l.othersQuietAt.IsZero() && !l.othersQuietAt.Before(l.chainStart) {
		// Nobody else listened when this chain's last handoff ran: the check at
		// the bound would hand over all the same, a round trip later. A new
		// chain starts, and its handoffs grant early (see noteListeners).
		bounded = false
		l.chain = 0
	}
	bound := "0"
	if bounded {
		bound = "1"
	}
	if l.chain == 0 {
		l.chainStart = now
	}
	l.chain++
	call := scriptCall{
		script: scripts.LockHandoff,
		keys:   l.releaseKeys,
		// Room for the direct-grant arguments, so appending them does not copy.
		args: append(make([]string, 0, 12),
			h.field, m.leaseText(h.lease), m.waiterField(w), m.leaseText(w.lease), bound, unlockMessage, "0"),
		purpose:  purposeHandoff,
		lock:     l.id,
		waiter:   w.id,
		receiver: w.owner,
		hold:     h.id,
		unlock:   future,
		owner:    h.owner,
		serial:   true,
	}
	early := m.canGrantEarly(l, h, w, bounded, now)
	if l.fair == nil {
		// At the chain bound the script may grant to another client's registered
		// waiter instead, and register w in this client's name (directgrant.go).
		reg := ""
		if bounded {
			reg = m.registration(w, now)
		}
		call.args = append(call.args, m.cfg.clientID, selfListens(l), reg, strconv.FormatUint(w.id, 10), "1")
	} else {
		// No bound: the fair script hands over only to the Redis queue's head (or,
		// early, to the waiter it was told heads it).
		call.script = scripts.FairHandoff
		call.keys = l.fair.keys
		call.args, call.run = m.fairHandoffArgs(h.field, h.lease, m.waiterField(w), w.lease, early, nil, w.next, now)
		if early {
			l.fairRun = l.fairRun[1:] // the rest still follows w
		} else {
			l.fairRun = nil // until the reply says who heads the queue
		}
	}
	if early {
		l.handingOff = true
		call.early = true
		call.releaserLost = h.lost // grantEarly drops h; a nil reply must close its Lost
		call.hold = m.grantEarly(l, h, w, now)
		m.run(call)
		return
	}
	// The call is w's attempt, as startAttempt's would be: the receiving owner's
	// calls, and its Settle, wait for it (see serial.go). A Settle that did not
	// would let an Acquire walked away during the call look as if it held
	// nothing, and then the grant be taken back after the owner's next call
	// returned.
	l.attempting = w
	l.wakePending = false
	w.attempting = true
	m.markBusy(holdKey{l.id, w.owner})
	m.run(call)
}

// grantEarly ends the releasing owner's local hold h and grants w in its place, under
// h's remaining lease, and returns the new hold's id (0 if the grant went back at
// once because w's context had ended).
func (m *machine) grantEarly(l *lockState, h *hold, w *waiter, now time.Time) uint64 {
	key := holdKey{l.id, w.owner}
	m.markBusy(key)
	m.serial[key].early = true
	// The grant's lease is dated so that it ends no later than h's: the server keeps
	// h's expiry until the handoff runs, and w's lease from then on.
	expires := h.expiresAt
	m.dropHold(h)
	sentAt := now
	if at := expires.Add(-m.leaseOf(w.lease)); at.Before(sentAt) {
		sentAt = at
	}
	m.grant(w, sentAt, now)
	nh := m.holds[key]
	if nh == nil {
		return 0
	}
	nh.provisional = true
	m.stats.EarlyGrants++
	return nh.id
}

func (m *machine) onHandoffDone(d scriptDone, now time.Time) {
	m.noteListeners(d)
	if d.call.early {
		m.onEarlyHandoffDone(d, now)
		return
	}
	l := m.lockByID[d.call.lock]
	h := m.holdByID[d.call.hold]
	w := m.waiters[d.call.waiter]
	if l != nil && l.attempting != nil && l.attempting.id == d.call.waiter {
		l.attempting = nil
	}
	if w != nil {
		w.attempting = false
	}
	switch {
	case d.err != nil:
		// Whether it ran is unknown: the releasing hold counts as lost and its
		// field goes, owner-guarded, as for a failed release (onUnlockDone).
		if h != nil {
			m.loseHold(h, true)
		}
		d.call.unlock.Complete(d.err)
		if w != nil {
			if d.call.script == scripts.LockHandoff && len(d.call.args) > 9 && d.call.args[9] != "" {
				w.registered = true // the script may have run: a leave then removes it
			}
			m.attemptFailed(w, d.err, now)
		}
	case handedOver(d):
		m.noteFairRun(l, d, nil)
		if h != nil {
			m.dropHold(h)
		}
		if l != nil && l.fair == nil && d.call.args[4] == "1" {
			// Handed over at the chain bound: nobody else listened, so nobody was
			// kept waiting. A new chain starts, whose handoffs may grant early; a
			// process that starts waiting just after waits one chain at most.
			l.chain = 0
		}
		d.call.unlock.Complete(nil)
		m.stats.Handoffs++
		if w != nil {
			m.grant(w, d.sentAt, now)
		} else if l != nil {
			m.abandon(l, d.call.receiver, d.call.args[2], 1)
		}
	case d.reply.Int == 1 || d.reply.Int == 4:
		// Released to everyone (chain bound), to a fair waiter ahead in the queue,
		// or (4) granted to another client's registered waiter, with this one
		// registered in its place: it waits for a grant, or its retry timer.
		if h != nil {
			m.dropHold(h)
		}
		if l != nil {
			l.chain = 0
		}
		d.call.unlock.Complete(nil)
		m.handoffRefused(w, d.call)
		switch {
		case d.reply.Int == 1 && l != nil && l.fair == nil:
			m.yieldToPublic(l) // released to everyone: others first (directgrant.go)
		case d.reply.Int != 4 || l == nil:
		case w != nil && w.queued && l.queue.head == w:
			// Registered; a grant to it may have been heard meanwhile.
			if !m.onRegisteredAttempt(w, false, d.sentAt, now) {
				m.park(l, m.leaseOf(w.lease), now)
			}
		default:
			// The waiter registered in this client's name is gone (or no longer
			// heads the queue): its registration (and a grant to it) goes, and
			// the next head attempts.
			if w != nil {
				w.grantHeard = false
			}
			m.runLeave(l, d.call.waiter, "")
		}
	case d.reply.Nil: // the releasing owner had lost the lock: the waiter retries normally
		d.call.unlock.Complete(m.unlockFoundLost(holdKey{d.call.lock, d.call.owner}, h))
		m.handoffRefused(w, d.call)
	default: // the releasing owner still holds it
		if h != nil && h.count > 1 {
			h.count--
		} else if h != nil {
			m.dropSurplus(h)
		}
		d.call.unlock.Complete(nil)
		m.handoffRefused(w, d.call)
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

// handoffRefused answers a waiter whose handoff call did not hand over if it was
// cancelled or ran out of time meanwhile; otherwise it stays at the head. The call
// was the waiter's attempt, and its owner still counts busy with it (see
// onScriptDone): what an earlier attempt of the waiter's may have taken is cleaned
// up now unless another call of the owner's is in flight (see finish).
func (m *machine) handoffRefused(w *waiter, call scriptCall) {
	if w == nil || (w.cancelErr == nil && !w.expired) {
		return
	}
	k := holdKey{w.lock.id, w.owner}
	own := 1 // the call, as the waiter's attempt
	if call.owner == w.owner {
		own++ // and as its owner's release
	}
	if q := m.serial[k]; w.ambiguous && q != nil && q.busy <= own {
		w.ambiguous = false
		m.undoAmbiguous(w)
	}
	err := w.cancelErr
	if err == nil {
		err = ErrNotAcquired
	}
	m.finish(w, err)
}

// onEarlyHandoffDone reads the reply of a handoff that granted early: it confirms
// the new hold, or ends it. The new hold may be gone already (a grant nobody
// received, a lost hold, Close); its owner-guarded cleanup runs after this reply.
func (m *machine) onEarlyHandoffDone(d scriptDone, now time.Time) {
	l := m.lockByID[d.call.lock]
	nh := m.holdByID[d.call.hold]
	var r *relay
	if l != nil {
		l.handingOff = false
		r, l.relay = l.relay, nil
	}
	if d.call.relayed != nil {
		// A relay's follow-up: the relayed holds ran under its releasing owner's
		// field, which it finds there (or already moved, on a retry) unless the
		// lock was lost meanwhile.
		m.answerRelay(d.call.relayed, relayOutcome(d, d.reply.Nil))
		if l != nil && l.fair != nil {
			m.fairFollowUpLeaves(l, d)
		}
	}
	swapped := false
	switch {
	case d.err != nil:
		// Twice a transport error (see retryOnce): either field may be on the server.
		// The releasing owner's goes (its Unlock reports the error), and so does the
		// new hold, whose Lost closes, and so does the releasing hold's.
		if d.call.releaserLost != nil {
			d.call.releaserLost.Fire()
		}
		answerUnlock(d.call.unlock, d.err)
		if l != nil {
			m.abandon(l, d.call.owner, d.call.args[0], 0)
		}
		if nh != nil {
			m.loseHold(nh, true)
		}
	case handedOver(d):
		// Handed over, by this try or (a retry's reply) by the first. The lease ran
		// from when the first try was sent at the earliest.
		m.noteFairRun(l, d, r)
		answerUnlock(d.call.unlock, nil)
		swapped = true
		m.stats.Handoffs++
		if nh != nil {
			sent := d.sentAt
			if !d.call.firstSent.IsZero() {
				sent = d.call.firstSent
			}
			m.confirmEarly(nh, sent)
		}
	case d.reply.Nil:
		// The releasing owner had lost the lock (a force-release; its lease had time
		// left): nothing was handed over. Its hold ended at the grant; its Lost, if
		// anybody asked for it, closes now.
		if d.call.releaserLost != nil {
			d.call.releaserLost.Fire()
		}
		answerUnlock(d.call.unlock, errHoldLost)
		if nh != nil {
			nh.provisional = false // nothing of its owner's is on the server
			m.loseHold(nh, false)
		}
	default:
		// 0: the server counted more holds of the releasing owner than the engine
		// (see dropSurplus), so nothing was handed over and the surplus goes; 1: never
		// answered without the chain bound.
		answerUnlock(d.call.unlock, nil)
		if l != nil && d.reply.Int == 0 {
			m.abandon(l, d.call.owner, d.call.args[0], 0)
		}
		if nh != nil {
			nh.provisional = false
			m.loseHold(nh, false)
		}
	}
	if l != nil && !swapped {
		l.fairRun = nil
	}
	m.sendWaitingCleanups(d.call.lock, d.call.receiver)
	if l != nil && l.fair != nil && !swapped {
		// Nothing was handed over (or, after two transport errors, maybe not): the
		// receiver's entry may still head the Redis queue, and its waiter is done.
		// It leaves, so the queue moves on at once rather than at its deadline;
		// before anything below frees an owner whose next attempt would find that
		// entry ahead of it.
		m.fairLeaveOwner(l, d.call.receiver, d.call.args[2])
	}
	if r != nil && l != nil {
		m.endRelay(l, r, d, swapped, now)
	}
	if d.call.relayed != nil && l != nil && l.fair != nil {
		// After endRelay: a follow-up it sent goes before anything this starts.
		m.releaseBetween(l, d.call.relayed, now)
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

// noteListeners records what the reply d of a plain lock's handoff says of the
// unlock channel's other listeners, when its call asked (lock_handoff's ARGV[12];
// at the bound it always says): 2, nobody but this client listened; 1, 4 or 5,
// somebody did. A retry's reply may come from its first try's early return and
// says nothing.
//
// Why: at the chain bound (handoffTarget) the script checks for other listeners
// and, finding none, hands over all the same; but the engine, not knowing which
// way it will go, cannot grant early, so the handoff costs the next holder a
// round trip and a wake-up. In one process contending alone (bench scenario C
// from one process, 1,000 waiters holding ~1 ms each) that was one handoff in
// sixteen, and a third of the mean idle gap per handoff. So every handoff asks,
// and at the bound, if the chain's last handoff said nobody else listened, the
// engine skips the check: the handoff goes unbounded (and early), and a new
// chain starts. A process that starts listening after that handoff ran is seen
// by the next one's reply, and waits at most one chain more than it would have.
func (m *machine) noteListeners(d scriptDone) {
	if d.call.script != scripts.LockHandoff || len(d.call.args) < 12 || d.call.args[11] != "1" ||
		d.err != nil || d.reply.Nil || d.call.retried {
		return
	}
	l := m.lockByID[d.call.lock]
	if l == nil {
		return
	}
	switch d.reply.Int {
	case 2:
		l.othersQuietAt = d.sentAt
	case 1, 4, 5:
		l.othersQuietAt = time.Time{}
	}
}

// answerUnlock answers the Unlock a handoff carries, if any: a relay's follow-up
// (relay.go) has none of its own.
func answerUnlock(f *futures.Future[error], err error) {
	if f != nil {
		f.Complete(err)
	}
}

// sendWaitingCleanups sends the receiver's owner-guarded cleanups that waited for
// its early handoff (see abandon), now that its reply is in: before anything else
// of the lock is sent, so each runs on the fields the handoff left, not on a field
// a new attempt of the same owner took since. The owner's other waiting requests
// (an Unlock, a re-entry) stay for markIdle.
func (m *machine) sendWaitingCleanups(lock, receiver uint64) {
	q := m.serial[holdKey{lock, receiver}]
	if q == nil {
		return
	}
	q.early = false
	kept := q.pending[:0]
	var cleanups []abandonMsg
	for _, msg := range q.pending {
		if c, ok := msg.(abandonMsg); ok {
			cleanups = append(cleanups, c)
			continue
		}
		kept = append(kept, msg)
	}
	clear(q.pending[len(kept):])
	q.pending = kept
	for _, c := range cleanups {
		m.runCleanup(c)
	}
}

// runCleanup sends a cleanup that waited (parkCleanup): for an early handoff's
// reply, or for the owner's call in flight. Its lock's state is live: the parked
// cleanup kept it so (cleanupsWaiting).
func (m *machine) runCleanup(c abandonMsg) {
	l := m.lockByID[c.lock]
	if l == nil {
		return
	}
	l.cleanupsWaiting--
	if c.leave {
		m.fairLeaveOwner(l, c.owner, c.field)
		return
	}
	if h := m.holds[holdKey{l.id, c.owner}]; (c.afterLoss || c.drop == 0 && c.relayed == nil) && h != nil && h.field == c.field {
		// The call it waited for took the field again (a lost hold's, see
		// releaseLost; or a taken-back grant's whose last count went whole, see
		// releaseOne, when a re-entry of another goroutine sharing the handle was
		// in flight): releasing the whole field would end that hold. Every
		// whole-field cleanup is of a hold that has ended here, so a hold found
		// under its field is a newer one; what it would have released goes at that
		// hold's last Unlock (see dropSurplus). (A relay's release, which
		// answers its Unlocks, goes as before.)
		h.maySurplus = true
		return
	}
	m.cleanUp(l, c)
}

// confirmEarly makes an early grant an ordinary hold: its lease now runs from the
// handoff's send time.
func (m *machine) confirmEarly(h *hold, sentAt time.Time) {
	h.provisional = false
	h.expiresAt = sentAt.Add(m.leaseOf(h.lease))
	if h.lease > m.cfg.watchdog && m.renewMayFollow(h.lock, sentAt) {
		h.expiresAt = sentAt.Add(m.cfg.watchdog) // as in addHold
	}
	if sentAt.Before(h.lock.forcedAt) {
		m.checkForced(h) // as in addHold
	}
	if h.lease == 0 {
		h.nextRenew = sentAt.Add(m.cfg.watchdog / 3)
	}
	// An armed expiry entry fires at the provisional deadline and re-arms itself
	// for this one (see onExpiry).
}
