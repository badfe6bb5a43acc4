package engine

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// The fair lock (Redisson's FairLock layout, shared/PROTOCOL.md) is the reentrant
// lock's hash plus a queue list and a deadline sorted set in Redis. FIFO holds
// across processes because every waiter is in the Redis queue, in arrival order, and
// a release wakes only the queue's head, on that waiter's own channel.
//
// What differs from the reentrant lock in this engine:
//
//   - Local waiters join the Redis queue in local arrival order, a batch at a
//     time: up to maxJoin first attempts go out in one step, so they travel in one
//     merged script call and run in order; the next batch starts once this one is
//     answered. Local order is Redis queue order (a waiter whose attempt failed
//     moves behind those that joined), and a burst of waiters costs a few calls.
//   - A release publishes on the head's own channel. Rather than one subscription per
//     waiter (a subscribe and an unsubscribe per handoff), a client subscribes one
//     pattern per lock, redisson_lock__channel:{name}:<client-id>:*, which receives
//     the per-waiter messages Redisson's scripts publish, unchanged: O(1)
//     subscriptions per lock per process, and Java clients see no difference.
//   - A message names its waiter, so exactly that waiter retries; each queued waiter
//     also retries when the entry ahead of it could go stale (its own timer), and at
//     least every FairWait/3, refreshing its deadline: a live waiter never loses its
//     place however long the lock is held (Redisson purges live waiters then).
//   - A waiter that gives up leaves the Redis queue at once (fair_leave.lua) and
//     those behind it move up; a waiter whose process died stops refreshing and is
//     purged by the next script once its deadline passes and it heads the queue.
//     No attempt for an owner starts while that owner's leave is in flight: the two
//     run on different goroutines, and a leave that overtook the new attempt would
//     delete the new queue entry (both use the owner's field).
//   - A local handoff needs no bound: the script hands over only when the local
//     waiter is the Redis queue's head, so it never jumps the queue. Its reply
//     also says how many of the next local waiters head the queue now, in order
//     (lockState.fairRun, fairrun.go); the handoff to the first grants early (see
//     handoff.go), and tells the script to hand over whatever it finds, so a
//     belief made stale by a purge can cost FIFO once, never exclusion; holders
//     that unlock before that handoff's reply relay the lock down the run with
//     no call (relay.go, fairrun.go).
//   - Direct grants (internal/scripts/fair_lib.lua): a queued waiter registers its
//     lease and id in leash_lock_grants:{name}, and a release whose head registered
//     gives it the lock in the same call and publishes "leash:grant:<id>" on its
//     channel. The head then needs no call of its own, so a handoff to another
//     process costs the release alone, as a local handoff does. Heads that did not
//     register (Redisson clients) are woken as Redisson expects.
//   - A grant heard by message was made at some moment the waiter cannot see; the
//     waiter dates it, safely early, at the send time of its last attempt that found
//     it still queued. When that date is older than a third of the lease, the waiter
//     claims the grant with a call instead (fair_acquire renews a hold it did not know
//     of rather than counting it twice), which dates it afresh.
//   - At most one local waiter per owner is in the Redis queue (they would share one
//     entry, and one grant): a second waiter of the same handle waits locally until
//     the first has the lock, then re-enters.
//
// Deadlines in the sorted set are milliseconds on the calling client's wall clock,
// as Redisson writes them, so hosts sharing a fair lock need synchronized clocks.
// The engine's own timing (retries, waits, leases) stays on the monotonic clock.

// fairKeys are the Redis names of a fair lock besides the hash itself.
type fairKeys struct {
	queue   string // redisson_lock_queue:{name}
	timeout string // redisson_lock_timeout:{name}
	pattern string // redisson_lock__channel:{name}:<client-id>:*, glob-escaped
	grants  string // leash_lock_grants:{name}: waiters registered for direct grants

	// acquireKeys are fair_acquire's KEYS; keys are every other fair script's
	// (hash, queue, deadlines, channel prefix, grants). Made once, shared read-only.
	acquireKeys, keys []string
}

func newFairKeys(lock, clientID string) fairKeys {
	k := fairKeys{
		queue:   "redisson_lock_queue:" + tagged(lock),
		timeout: "redisson_lock_timeout:" + tagged(lock),
		pattern: globEscape(channelName(lock)+":"+clientID+":") + "*",
		grants:  "leash_lock_grants:" + tagged(lock),
	}
	k.acquireKeys = []string{lock, k.queue, k.timeout, k.grants}
	k.keys = []string{lock, k.queue, k.timeout, channelName(lock), k.grants}
	return k
}

// globEscape escapes the characters Redis glob patterns treat specially.
func globEscape(s string) string {
	if !strings.ContainsAny(s, `*?[]\`) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// fairOwner parses a per-waiter channel, "<lock channel>:<client-id>:<owner>", of
// this client into the lock channel and the owner.
func fairOwner(channel, clientID string) (string, uint64, bool) {
	sep := ":" + clientID + ":"
	i := strings.LastIndex(channel, sep)
	if i < 0 {
		return "", 0, false
	}
	owner, err := strconv.ParseUint(channel[i+len(sep):], 10, 64)
	if err != nil {
		return "", 0, false
	}
	return channel[:i], owner, true
}

func wallMillis(now time.Time) string { return strconv.FormatInt(now.UnixMilli(), 10) }

// fairAttempt runs fair_acquire for w: take, re-enter, or (unless a single try)
// join the Redis queue.
func (m *machine) fairAttempt(w *waiter, now time.Time) {
	l := w.lock
	try, register := "0", ""
	lease := m.leaseOf(w.lease)
	// A queued waiter's own attempts claim an unheard direct grant: the grant was
	// made to it. So does a single try of a handle that holds nothing here: its
	// handle's queued waiter may have been granted, and a re-entry of that grant
	// would count twice on Redis where the engine counts once (the try's reply
	// takes the waiter out of the queue, ownerEntryTaken, and the grant's message
	// then grants nobody). The message cannot count it again: fairGranted grants
	// nobody while the try is in flight, and after its reply the waiter is out of
	// the queue if the try took the lock. A holder's re-entry never claims.
	claim := "0"
	if !w.direct || w.oneShot {
		claim = m.claimFlag(l, w.owner)
	}
	joining := w.joinPending
	w.joinPending = false
	if w.oneShot {
		try = "1"
	} else if joining && l.handingOff {
		try = "2" // join only (see fairAdvance)
	}
	if !w.oneShot && lease <= m.cfg.fairWait {
		// A waiter whose process dies after a direct grant holds the lock for its
		// lease; one whose lease is longer than it would keep its place in the queue
		// when gone (fairWait) is woken instead, and takes the lock itself.
		// Each registration is numbered ("<waiter id>.<n>"), and a grant's message
		// names the registration it was made to: see fairGranted.
		w.regs++
		w.claimOnly = false // a grant to an earlier registration is this call's to take
		register = m.leaseText(w.lease) + ":" + grantName(w)
	}
	m.run(scriptCall{
		joining: joining,
		// A first attempt on a fair lock whose last release here found nobody
		// queued, with no hold or other waiter here: the lone lane may take it
		// with plain commands (scripts.FreshFairRunner).
		fresh: joining && try != "2" && l.quietLast && len(l.holders) == 0 && l.queue.len == 1 &&
			l.leaving[w.owner] == 0,
		channel: l.channel,
		script:  scripts.FairAcquire,
		keys:    l.fair.acquireKeys,
		args: []string{m.leaseText(w.lease), m.waiterField(w), m.fairWaitText, wallMillis(now), try,
			register, claim},
		purpose: purposeAttempt,
		lock:    l.id,
		waiter:  w.id,
		owner:   w.owner,
		// Every fair attempt is one of its owner's serialized calls (serial.go):
		// a queued one too, as a waiter's handle may come to hold the lock while
		// it is in flight (another goroutine's Lock of the handle), and the
		// handle's Unlock must not race it.
		serial: true,
	})
}

// claimFlag is "1" when owner holds nothing on l as far as this engine knows, and
// no release of its is in flight: a hold of owner that a fair script finds is then
// a direct grant not yet heard of.
func (m *machine) claimFlag(l *lockState, owner uint64) string {
	if m.holds[holdKey{l.id, owner}] != nil || l.leaving[owner] > 0 {
		return "0"
	}
	return "1"
}

// addLeaving records a fair_leave or an abandon of owner in flight (see
// onLeaveDone).
func (m *machine) addLeaving(l *lockState, owner uint64) {
	if l.leaving == nil {
		l.leaving = make(map[uint64]int)
	}
	l.leaving[owner]++
}

// maxJoin bounds a batch of waiters joining the Redis queue together: 64
// fair_acquire calls of four keys, half of one merged script call's keys
// (scripts.MaxMergedKeys).
const maxJoin = 64

// fairAdvance starts a fair lock's next attempts: the earliest woken waiter
// already in the Redis queue (one such retry at a time), and, unless a batch is
// still joining, the next local waiters not yet in the Redis queue, in order, up to
// maxJoin of them, stopping at one that must wait (its owner is leaving, has a
// serialized call in flight, or is already queued by another waiter). A waiter
// whose owner holds the lock re-enters instead (fairReenter).
func (m *machine) fairAdvance(l *lockState, now time.Time) {
	// While an early handoff is in flight, the releasing owner's field is still on
	// the server although its local hold is gone: an attempt of that owner's (or of
	// the receiver's) must not reach Redis first, and those owners are busy. Other
	// owners join the queue meanwhile, but only join: one that found the lock free
	// (a force-release took it) would take it while the receiver holds here. No
	// queued waiter retries and nobody re-enters; onEarlyHandoffDone advances.
	if l.backingOff || m.closing {
		return
	}
	// The walks below are O(waiters) per call; with a batch joining and no retry
	// to start (one is in flight, or a handoff is), there is nothing to do.
	if l.joining > 0 && (l.handingOff || l.attempting != nil) {
		return
	}
	w := l.queue.head
	for ; w != nil && w.enqueued; w = w.next {
		if !l.handingOff && l.attempting == nil && w.wake && !w.attempting && !m.ownerBusy(holdKey{l.id, w.owner}) &&
			l.leaving[w.owner] == 0 { // as a join waits for its owner's leave (below); onLeaveDone advances
			l.attempting = w
			w.wake = false
			m.markBusy(holdKey{l.id, w.owner})
			m.attempt(w, now)
			if l.joining > 0 {
				return
			}
		}
	}
	if l.joining > 0 {
		return
	}
	var batch []uint64 // owners in this batch
	var reenter []*waiter
	for ; w != nil && len(batch) < maxJoin; w = w.next {
		if w.enqueued {
			continue // behind one that could not join yet (see fairRequeue)
		}
		key := holdKey{l.id, w.owner}
		if m.holds[key] != nil && l.handingOff {
			break
		}
		if m.holds[key] != nil && !m.ownerBusy(key) && !w.attempting {
			// A waiter that queued while another waiter of its handle was ahead,
			// which now holds: it re-enters, as a holder's Lock does.
			reenter = append(reenter, w)
			continue
		}
		if w.attempting || m.ownerBusy(key) || l.leaving[w.owner] > 0 || slices.Contains(batch, w.owner) || m.ownerQueued(l, w.owner) {
			break
		}
		batch = append(batch, w.owner)
		l.joining++
		w.wake = false
		w.joinPending = true
		m.markBusy(key)
		m.attempt(w, now)
	}
	for _, w := range reenter {
		m.fairReenter(w, now)
	}
}

// ownerEntryTaken records that owner has just taken l: whatever took it (its
// attempt, a direct grant, a handoff) took the owner's entry out of the Redis
// queue, or (a handoff that did not hand over) a leave takes it out. An owner has
// one entry, one field, for all its waiters: another local waiter of the owner
// that stood in the queue under that entry stands there no longer. It re-enters
// while the owner holds, and joins again after (see fairAdvance).
func (m *machine) ownerEntryTaken(l *lockState, owner uint64) {
	for v := l.queue.head; v != nil; v = v.next {
		if v.owner == owner && v.enqueued && !v.attempting {
			v.enqueued = false
			m.disarm(kindFairRetry, v.id, &v.retryGen)
		}
	}
}

// fairReenter sends w's attempt as a holder's re-entry, out of the local queue and
// serialized with its owner's other calls (see serial.go), as a Lock of a handle
// that holds is. Queued attempts are serialized too (fairAttempt), yet sending
// this one as an ordinary join instead brought back lost holds and two holders in
// the shared-handle stress test: the join path's bookkeeping (joinPending, the
// batch, claims) assumes an owner that holds nothing.
func (m *machine) fairReenter(w *waiter, now time.Time) {
	key := holdKey{w.lock.id, w.owner}
	if m.ownerBusy(key) {
		return // another waiter of the owner re-enters first; advance comes back
	}
	w.lock.queue.remove(w)
	w.wake = false
	w.direct = true
	m.markBusy(key)
	m.attempt(w, now)
}

// fairRequeue keeps local order Redis queue order for w, which has just joined the
// Redis queue's tail (a refused re-entry) or failed to join: it moves right behind
// the last local waiter in the Redis queue if that one stands behind it, and stays
// put otherwise (so a batch that failed whole keeps its order).
func (m *machine) fairRequeue(w *waiter) {
	l := w.lock
	var last *waiter // the last local waiter in the Redis queue, w aside
	enqueuedBehind, passed := false, false
	for v := l.queue.head; v != nil; v = v.next {
		switch {
		case v == w:
			passed = true
		case v.enqueued:
			last = v
			enqueuedBehind = passed
		}
	}
	if w.queued {
		if !enqueuedBehind {
			return
		}
		l.queue.remove(w)
	}
	l.queue.insertAfter(last, w)
}

// ownerQueued reports whether a local waiter of owner stands in the leading run
// of l's local queue that is in the Redis queue: the waiters fairAdvance retries.
// A waiter behind that run does not join while one of its owner's does (the
// owner has one entry). A waiter of the owner's further back, behind a waiter
// out of the Redis queue, does not count: the waiter in front of it joins (its
// join finds the owner's entry), so the run, and the retries, reach past it.
func (m *machine) ownerQueued(l *lockState, owner uint64) bool {
	for w := l.queue.head; w != nil && w.enqueued; w = w.next {
		if w.owner == owner {
			return true
		}
	}
	return false
}

// ownerEnqueued reports whether any local waiter of owner is in l's Redis queue,
// wherever it stands in the local queue: a waiter whose entry another call of its
// handle took stays where it stood, out of the Redis queue (ownerEntryTaken), and
// the waiters behind it may still be in it.
func (m *machine) ownerEnqueued(l *lockState, owner uint64) bool {
	for w := l.queue.head; w != nil; w = w.next {
		if w.enqueued && w.owner == owner {
			return true
		}
	}
	return false
}

// fairRefused handles a fair_acquire reply that is a wait: w is now in the Redis
// queue and retries when its timer fires or its channel says so. sentAt, when the
// call was sent, is the earliest moment a direct grant to w can have been made.
func (m *machine) fairRefused(w *waiter, ttl time.Duration, sentAt, now time.Time) {
	l := w.lock
	l.backoff = 0
	w.ambiguous = false // the server answered (see attemptRefused)
	if !w.oneShot {
		w.enqueued = true
		w.queuedAt = sentAt
	}
	if m.settleRefusal(w) {
		return
	}
	m.subscribe(l)
	d := m.fairRetryDelay(ttl)
	if !w.deadline.IsZero() {
		d = min(d, w.deadline.Sub(now))
	}
	m.armFairRetry(w, max(d, minBackoff))
}

// fairRetryDelay turns fair_acquire's wait into when a queued waiter retries: when
// the entry ahead could go stale, and at least every fairWait/3 to refresh its own
// deadline. A lock without an expiry has no deadline to wait for.
func (m *machine) fairRetryDelay(ttl time.Duration) time.Duration {
	refresh := max(m.cfg.fairWait/3, minBackoff)
	switch {
	case ttl == -time.Millisecond:
		return min(noTTLRetry, refresh)
	case ttl == -2*time.Millisecond:
		// The lock was free, and a join-only attempt left it (see fairAdvance):
		// the retry takes it if nobody has by then.
		return minBackoff
	case ttl <= 0:
		return refresh
	}
	return min(ttl, refresh)
}

func (m *machine) armFairRetry(w *waiter, d time.Duration) {
	m.rearm(kindFairRetry, w.id, &w.retryGen, d)
}

func (m *machine) onFairRetry(key timer.Key, now time.Time) {
	w := m.waiters[key.ID]
	if w == nil || w.retryGen != key.Gen {
		return
	}
	w.retryGen = 0
	w.wake = true
	m.fairAdvance(w.lock, now)
}

// grantPrefix starts the message of a direct grant: "leash:grant:<grant name>",
// the name being the one the waiter registered with (grantName).
const grantPrefix = "leash:grant:"

// grantName is what w's latest registration for a direct grant names it by:
// "<waiter id>.<registration number>".
func grantName(w *waiter) string {
	return strconv.FormatUint(w.id, 10) + "." + strconv.FormatUint(uint64(w.regs), 10)
}

// fairNotice routes a per-waiter message to its waiter.
func (m *machine) fairNotice(channel, payload string, now time.Time) {
	base, owner, ok := fairOwner(channel, m.cfg.clientID)
	if !ok {
		return
	}
	l := m.lockByChannel[base]
	if l == nil || l.fair == nil {
		return
	}
	if id, ok := strings.CutPrefix(payload, grantPrefix); ok {
		m.fairGranted(l, owner, id, now)
		return
	}
	// A waiter whose first attempt is in flight may have queued, and been woken,
	// before its reply comes.
	for w := l.queue.head; w != nil; w = w.next {
		if w.owner == owner && (w.enqueued || w.attempting) {
			m.stats.Notices++
			w.wake = true
			m.fairAdvance(l, now)
			return
		}
	}
}

// fairGranted takes a direct grant's message, which names the registration the
// grant was made to (grantName). A grant to a waiter that is gone (left: its leave
// gives the grant back; claimed: its attempt took it) is ignored, and so is one
// made to an earlier registration of w than its latest: w's later attempt ran
// after that grant, and took it (claimed or re-entered), or another call of the
// owner's took it first (a single try's claim: see fairAttempt), maybe to give it
// back since; granting w on it now would count a hold Redis may not have. A
// waiter whose attempt is in flight retries after it, and that attempt or the next
// claims the grant. Otherwise the grant is dated at w.queuedAt (see the top of
// the file) and recorded, or claimed with a call when that date is too old.
func (m *machine) fairGranted(l *lockState, owner uint64, name string, now time.Time) {
	idText, regText, numbered := strings.Cut(name, ".")
	id, err := strconv.ParseUint(idText, 10, 64)
	w := m.waiters[id]
	if err != nil || w == nil || w.lock != l || w.owner != owner || !(w.enqueued || w.attempting) {
		return
	}
	if numbered && regText != strconv.FormatUint(uint64(w.regs), 10) {
		return // an earlier registration's: see above
	}
	m.stats.Notices++
	if w.attempting || w.claimOnly || m.ownerBusy(holdKey{l.id, owner}) || now.Sub(w.queuedAt) > m.leaseOf(w.lease)/3 {
		// An attempt in flight (even the one that queued w, whose reply may come
		// after this message) is followed by another, which claims the grant. So
		// is another call of the owner's (a single try of the same handle, which
		// may claim the grant itself: see fairAttempt); w's attempt waits for it.
		// A grant another call of the owner's may have touched (claimOnly) is
		// claimed too, which also sets its expiry to w's lease.
		w.wake = true
		m.fairAdvance(l, now)
		return
	}
	m.stats.DirectGrants++
	m.grant(w, w.queuedAt, now)
	if h := m.holds[holdKey{l.id, owner}]; h != nil {
		// Dated early for its expiry, but for a force-release's reply it counts as
		// granted when heard of (see onForceDone).
		h.grantedAt = now
	}
	m.advance(l, now)
	m.maybeForget(l)
}

// fairGrantsInDoubt: an acquire of owner's on l (failed's) failed with a transport
// error, so it may have run, and found a direct grant made to another waiter of
// the owner's that the engine has not heard of: claimed it, or re-entered it,
// and set its expiry to failed's lease, which may be shorter than the waiter's.
// The grant's message, if it comes, then must not grant the waiter as it stands
// (dated by the waiter's lease, no call): each of the owner's queued waiters
// claims its grant with a call instead, which re-applies its own lease, until its
// next registration (fairAttempt).
func (m *machine) fairGrantsInDoubt(l *lockState, owner uint64, failed *waiter) {
	for w := l.queue.head; w != nil; w = w.next {
		if w != failed && w.owner == owner && w.enqueued {
			w.claimOnly = true
		}
	}
}

// fairWakeFirst wakes the first local waiter in the Redis queue: after a
// (re)subscription a message for it may have been missed.
func (m *machine) fairWakeFirst(l *lockState, now time.Time) {
	if w := l.queue.head; w != nil && w.enqueued {
		w.wake = true
	}
	m.fairAdvance(l, now)
}

// fairLeave takes a waiter that gives up out of the Redis queue at once.
func (m *machine) fairLeave(w *waiter) {
	w.enqueued = false
	m.disarm(kindFairRetry, w.id, &w.retryGen)
	m.fairLeaveOwner(w.lock, w.owner, m.waiterField(w))
}

// fairLeaveOwner takes owner's entry (field) out of l's Redis queue, and gives
// back a direct grant to it that this client does not know of.
func (m *machine) fairLeaveOwner(l *lockState, owner uint64, field string) {
	// Another local waiter of the owner's may stand in the Redis queue under the
	// same entry (one that joined behind an unqueued local head: see
	// ownerQueued): the entry is its, and so is a direct grant made to it. The
	// leave would take both away while that waiter, still counting itself
	// queued, could be granted by the grant's message. The entry stays; the
	// waiter retries at once, which registers it under its own name and claims
	// a grant made meanwhile (to a registration of the waiter that gave up).
	for v := l.queue.head; v != nil; v = v.next {
		if v.owner == owner && v.enqueued {
			v.wake = true
			return
		}
	}
	// A release of the owner's in flight (an abandon) would delete what this leave
	// gives back; deleting twice is harmless, so only a hold this client knows of
	// keeps the leave from giving back.
	// A leave that may give back a grant is one of the owner's give-backs, which
	// HoldCount waits for (see onSettle).
	claim, giveBack := "1", uint64(0)
	k := holdKey{l.id, owner}
	if q := m.serial[k]; m.holds[k] == nil && q != nil && q.busy > m.ownCalls(k) && !q.early {
		// An acquire of the owner's is in flight (a single try of a handle shared
		// by goroutines, a handoff to it; the owner holds nothing here, so no
		// re-entry): Redis may run it first,
		// and a claim would then give back the hold it takes while the engine
		// grants it. The leave waits for its reply, and claims only if it took
		// nothing (see runCleanup).
		m.parkCleanup(l, abandonMsg{lock: l.id, owner: owner, field: field, leave: true})
		return
	}
	if m.holds[k] != nil {
		claim = "0"
	} else {
		giveBack = m.startGiveBack(holdKey{l.id, owner})
	}
	m.addLeaving(l, owner)
	m.run(scriptCall{
		script:   scripts.FairLeave,
		keys:     l.fair.keys,
		args:     []string{field, m.fairWaitText, unlockMessage, wallMillis(m.now), claim},
		purpose:  purposeLeave,
		lock:     l.id,
		owner:    owner,
		giveBack: giveBack,
	})
}

// retryLeaveLater sends a leave again after a back-off when its retry failed too
// (a transport error twice), and reports whether it will: a fair leave, or the
// reentrant lock's lock_leave (directgrant.go).
//
// A fair leave that never runs leaves its waiter's entry in the Redis queue,
// where, once it heads the queue, it keeps every waiter of every process out until
// its deadline passes (the wait allowance: five minutes by default); a lock_leave
// that never runs leaves a direct grant to a gone waiter holding the lock for
// nobody until its lease ends, and the waiter's registration in Redis, where each
// release grants to it (and this client gives it back) until it expires. So a
// leave is sent until it runs, or the client closes; meanwhile the owner counts
// as leaving (a lock_leave's waiter, if still there, as w.leaving), so its next
// attempt, which would take the same entry or grant, waits.
func (m *machine) retryLeaveLater(d scriptDone) bool {
	l := m.lockByID[d.call.lock]
	leave := d.call.purpose == purposeLeave || d.call.script == scripts.LockLeave
	if !leave || d.err == nil || isRedisError(d.err) || m.closing || l == nil {
		return false
	}
	call := d.call
	call.retried = true // each send is tried once: the back-off spaces them
	call.backoff = min(max(2*call.backoff, minBackoff), maxBackoff)
	m.leaveRetrySeq++
	m.leaveRetries[m.leaveRetrySeq] = call
	l.inflight++ // the lock's state stays live while the leave is pending
	m.schedule(timer.Key{Kind: kindLeaveRetry, ID: m.leaveRetrySeq}, call.backoff)
	return true
}

// onLeaveRetry sends a leave that retryLeaveLater put off.
func (m *machine) onLeaveRetry(id uint64) {
	call, ok := m.leaveRetries[id]
	if !ok {
		return
	}
	delete(m.leaveRetries, id)
	l := m.lockByID[call.lock]
	if l != nil {
		l.inflight-- // run counts it again
	}
	if !m.withoutStaleDrop(&call) {
		m.maybeForget(l)
		return
	}
	call.args = slices.Clone(call.args)
	if call.script == scripts.LockLeave {
		// Its registration of the next waiter (ARGV[6]) would be stale by now, and
		// that waiter may be gone: its attempts register it again.
		call.args[5] = ""
	} else {
		// fair_leave's ARGV[4] is now on this client's clock: the deadlines it
		// sets and purges by must not be an outage old.
		call.args[3] = wallMillis(m.now)
	}
	m.run(call)
}

// onLeaveDone: the owner's leave has run, so its next attempt may start.
func (m *machine) onLeaveDone(d scriptDone, now time.Time) {
	l := m.lockByID[d.call.lock]
	if l == nil {
		return
	}
	if l.leaving[d.call.owner]--; l.leaving[d.call.owner] <= 0 {
		delete(l.leaving, d.call.owner)
	}
	m.advance(l, now)
	m.maybeForget(l)
}
