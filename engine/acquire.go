package engine

import (
	"slices"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Acquiring: a request becomes a waiter, queues FIFO, and the head attempts when
// the lock may be free (an unlock message, its retry timer, a subscription).

func (m *machine) onAcquire(msg acquireMsg, now time.Time) {
	if m.closing {
		m.complete(msg.future, msg.stop, WrapError(msg.lock, ErrClosed))
		return
	}
	if err := msg.ctx.Err(); err != nil {
		m.complete(msg.future, msg.stop, err)
		return
	}
	l := m.lockFor(msg.lock, msg.fair)
	if (l.fair != nil) != msg.fair {
		m.complete(msg.future, msg.stop, WrapError(msg.lock, errKindMismatch))
		m.maybeForget(l)
		return
	}
	key := holdKey{l.id, msg.owner}
	delete(m.parkedAcquires, msg.id) // handled now, if it waited (see parkAcquire)
	// A grant of the handle's that its caller walked away from, its cancellation
	// still on its way, goes back first (its give-back then holds this request
	// up, parkAcquire): a goroutine sharing the handle must not see a count that
	// nobody holds added to its own.
	seq := m.giveBackSeq
	m.takeBackWalkedAway(l, msg.owner)
	if m.giveBackSeq != seq {
		msg.giveBacksBefore = 0 // a request handled before waits for these give-backs too
	}
	direct := m.holds[key] != nil || msg.wait == 0
	if direct && m.parkAcquire(key, msg) {
		return
	}
	w := &waiter{
		id:     msg.id,
		lock:   l,
		owner:  msg.owner,
		lease:  msg.lease,
		ctx:    msg.ctx,
		stop:   msg.stop,
		future: msg.future,
	}
	if msg.wait > 0 {
		w.deadline = now.Add(msg.wait)
		m.schedule(timer.Key{Kind: kindWait, ID: w.id}, msg.wait)
	}
	m.waiters[w.id] = w
	m.stats.Acquires++

	// A holder re-entering, and a single try (wait 0, as sync.Mutex.TryLock), go
	// straight to Redis: queueing a holder behind waiters that wait for it would
	// deadlock, and a single try has nothing to wait for.
	if direct {
		w.oneShot = msg.wait == 0
		w.direct = true
		m.markBusy(key)
		m.attempt(w, now)
		return
	}
	l.queue.push(w)
	m.advance(l, now)
	m.maybeForget(l) // advance may have pruned w at once
}

// advance starts the head's attempt when nothing is in flight and the lock may be
// free. When this process holds the lock itself, the head waits: the holder's
// Unlock hands over, and the retry timer covers a holder whose lease runs out.
func (m *machine) advance(l *lockState, now time.Time) {
	m.pruneCancelled(l)
	if l.backingOff {
		return
	}
	if l.fair != nil {
		m.fairAdvance(l, now)
		return
	}
	if l.attempting != nil || l.handingOff || l.queue.head == nil || m.closing || m.yieldPending(l) {
		return
	}
	if l.wakePending {
		m.startAttempt(l, now)
		return
	}
	if l.parked {
		return
	}
	if len(l.holders) > 0 {
		m.park(l, m.localHoldTTL(l, now), now)
		return
	}
	m.startAttempt(l, now)
}

// mayBeFree records that the lock may have become free (a local hold ended without
// a release message, a force-release, this client's own release whose message may
// have gone unheard): a parked head retries; for a fair lock, the first local
// waiter in the Redis queue.
func (m *machine) mayBeFree(l *lockState) {
	l.parked = false
	if l.fair == nil && l.attempting != nil {
		// The attempt in flight may have run before the lock became free: its head
		// retries once more if refused, as for an unlock message (wakeHead).
		l.wakePending = true
	}
	if l.fair != nil {
		if w := l.queue.head; w != nil && w.enqueued {
			w.wake = true
		}
	}
}

// pruneCancelled answers queued waiters at the front whose context has already
// ended, before their cancellation message arrives: handing the lock to one of them
// would only cost a grant and a release.
func (m *machine) pruneCancelled(l *lockState) {
	for w := l.queue.head; w != nil && !w.attempting; w = l.queue.head {
		err := w.ctx.Err()
		if err == nil {
			return
		}
		m.finish(w, err)
	}
}

// startAttempt starts the head waiter's attempt, as one of its owner's serialized
// calls: the owner may hold the lock through another waiter of a shared handle, and
// its attempt (a re-entry then) must not cross the owner's Unlock. While the owner
// has a serialized call or a give-back in flight the attempt waits (wakePending);
// markIdle and giveBackDone advance the lock again.
func (m *machine) startAttempt(l *lockState, now time.Time) {
	w := l.queue.head
	l.parked = false
	if k := (holdKey{l.id, w.owner}); m.ownerBusy(k) || m.givingBack(k) || w.leaving > 0 {
		l.wakePending = true
		return
	}
	l.attempting = w
	l.wakePending = false
	m.markBusy(holdKey{l.id, w.owner})
	m.attempt(w, now)
}

func (m *machine) attempt(w *waiter, now time.Time) {
	w.attempting = true
	m.stats.Attempts++
	h := m.holds[holdKey{w.lock.id, w.owner}]
	if h != nil {
		m.shortenForReentry(h, w.lease, now)
	}
	if w.lock.fair != nil {
		m.fairAttempt(w, now)
		return
	}
	// A holder re-enters under its hold's field, which is a grant field when the
	// hold came from a direct grant (see directgrant.go).
	field := m.waiterField(w)
	if h != nil {
		field = h.field
	}
	w.sentField = field
	keys, args := m.attemptArgs(w, field, now)
	m.run(scriptCall{
		script:  scripts.LockAcquire,
		keys:    keys,
		args:    args,
		purpose: purposeAttempt,
		lock:    w.lock.id,
		waiter:  w.id,
		owner:   w.owner,
		serial:  true, // a direct call, or a queued one made serialized by startAttempt
		fresh:   len(keys) == 1 && len(w.lock.holders) == 0 && !w.lock.refusedLast,
	})
}

// reentryGone follows the reply of a re-entry whose waiter is gone: if it ran
// (granted, or failed in transit) it set the lock's expiry to its lease, which a
// given-back count does not undo, and a renewal sent before now may have run
// before it: the hold's lease is in doubt (reentryMayHaveRun).
func (m *machine) reentryGone(l *lockState, d scriptDone, now time.Time) {
	if h := m.holds[holdKey{l.id, d.call.owner}]; h != nil && h.reentryLease > 0 && !isRedisError(d.err) {
		m.reentryMayHaveRun(h, h.reentryLease, d.sentAt, now)
	}
}

// shortenForReentry brings h's expiry forward to now plus lease (0: the
// watchdog's) when that is sooner: a re-entry with that lease is about to be sent,
// and when it runs the script sets the lock's expiry to it, for the whole hold.
// Another goroutine sharing the handle may be inside on h already, and must hear
// from Lost before the key can expire, not once the re-entry's reply is in (a
// reply can take longer than a short lease). Until that reply the owner counts
// busy, so no renewal's reply moves the expiry back (onRenewDone); the reply's
// grant sets the hold's new lease (addHold), a failure leaves it in doubt
// (reentryMayHaveRun), a refusal ends the hold.
func (m *machine) shortenForReentry(h *hold, lease time.Duration, now time.Time) {
	lease = m.leaseOf(lease)
	if !now.Add(lease).Before(h.expiresAt) {
		return
	}
	h.expiresAt = now.Add(lease)
	if h.reentryLease == 0 || lease < h.reentryLease {
		h.reentryLease = lease
	}
	m.armExpiry(h, now)
}

// waiterField is w's owner field, "<client-id>:<owner-id>", made once per waiter,
// or taken from its lock when the lock's last field made was its owner's (a handle
// locking the same lock again, the common case).
func (m *machine) waiterField(w *waiter) string {
	if w.field == "" {
		l := w.lock
		if l.fieldOwner != w.owner || l.field == "" {
			l.field, l.fieldOwner = ownerField(m.cfg.clientID, w.owner), w.owner
		}
		w.field = l.field
	}
	return w.field
}

func (m *machine) leaseOf(lease time.Duration) time.Duration {
	if lease > 0 {
		return lease
	}
	return m.cfg.watchdog
}

// leaseText is millis(m.leaseOf(lease)), the watchdog's text made once.
func (m *machine) leaseText(lease time.Duration) string {
	if lease > 0 {
		return millis(lease)
	}
	return m.watchdogText
}

// park makes sure a lock with waiters hears about releases: its channel subscribed,
// and a retry timer armed for when the holder's lease could run out (a holder that
// dies publishes nothing).
func (m *machine) park(l *lockState, ttl time.Duration, now time.Time) {
	l.parked = true
	m.subscribe(l)
	if w := l.queue.head; w != nil && !w.deadline.IsZero() {
		ttl = min(ttl, w.deadline.Sub(now))
	}
	if w := l.queue.head; w != nil && w.registered {
		// A registered waiter registers afresh at least every third of its lease,
		// so a grant's date (its registration's) is never older (directgrant.go).
		ttl = min(ttl, m.leaseOf(w.lease)/3)
	}
	m.armRetry(l, ttl)
}

func (m *machine) armRetry(l *lockState, d time.Duration) { m.rearm(kindRetry, l.id, &l.retryGen, d) }

func (m *machine) disarmRetry(l *lockState) { m.disarm(kindRetry, l.id, &l.retryGen) }

// rearm replaces the timer of kind and id whose generation *gen holds (0: none)
// with one firing after d, under a new generation: a firing of the replaced
// timer that is already on its way then carries a stale generation.
func (m *machine) rearm(kind uint8, id uint64, gen *uint64, d time.Duration) {
	m.disarm(kind, id, gen)
	m.nextID++
	*gen = m.nextID
	m.schedule(timer.Key{Kind: kind, ID: id, Gen: *gen}, d)
}

// disarm cancels the timer of kind and id whose generation *gen holds, if any.
func (m *machine) disarm(kind uint8, id uint64, gen *uint64) {
	if *gen != 0 {
		m.cancelTimer(timer.Key{Kind: kind, ID: id, Gen: *gen})
		*gen = 0
	}
}

// localHoldTTL is how long until the earliest local hold of l could expire.
func (m *machine) localHoldTTL(l *lockState, now time.Time) time.Duration {
	ttl := m.cfg.watchdog
	for _, h := range l.holders {
		ttl = min(ttl, h.expiresAt.Sub(now))
	}
	return max(ttl, 0)
}

// resendRefusedFresh sends a fresh attempt again as the acquire script when a
// batch's RESTORE for it was refused (scripts.ErrFreshRefused: the lock exists,
// held elsewhere most likely, or RESTORE is not allowed; nothing ran), at once
// and as the same attempt: its waiter and lock stay attempting, its owner busy.
// The lock counts as refused here, so its next attempts go as the script from
// the start. It reports whether it did: not for a waiter that is gone,
// cancelled or out of time, nor while the engine closes (onScriptDone then
// answers the attempt as a refusal).
func (m *machine) resendRefusedFresh(d scriptDone) bool {
	l := m.lockByID[d.call.lock]
	if l == nil {
		return false
	}
	l.refusedLast = true
	l.quietLast = false // held elsewhere: its holder's waiters may listen
	w := m.waiters[d.call.waiter]
	if w == nil || w.cancelErr != nil || w.expired || m.closing {
		return false
	}
	retry := d.call
	retry.fresh = false
	m.run(retry)
	return true
}

// onAttemptDone reads an acquire reply: nil = held, an integer = the lock's PTTL.
func (m *machine) onAttemptDone(d scriptDone, now time.Time) {
	l := m.lockByID[d.call.lock]
	w := m.waiters[d.call.waiter]
	if l != nil && l.attempting != nil && l.attempting.id == d.call.waiter {
		l.attempting = nil
	}
	if l != nil && d.call.joining {
		l.joining--
	}
	granted := d.err == nil && d.reply.Nil
	if l != nil && l.fair == nil && d.err == nil {
		l.refusedLast = !granted
	}
	if l != nil && d.err == nil && !granted {
		l.quietLast = false // held elsewhere: its holder's waiters may listen, or queue
	}
	// registered: the attempt carried a registration for direct grants (see
	// directgrant.go); claimed: it found a grant to the waiter's grant field.
	registered := l != nil && l.fair == nil && len(d.call.args) > 4
	claimed := registered && d.err == nil && !d.reply.Nil && d.reply.Int == -3
	if w == nil {
		// The waiter is gone (cancelled, closed): give back what the script granted.
		switch {
		case granted && l != nil:
			m.reentryGone(l, d, now)
			m.abandon(l, d.call.owner, d.call.args[1], 1)
		case registered:
			if claimed {
				m.noteClaimed(d.call.waiter)
			}
			m.runLeave(l, d.call.waiter, "") // its registration, and a grant it claimed
		case d.err != nil && l != nil:
			m.reentryGone(l, d, now)
		}
		if l != nil {
			m.advance(l, now)
			m.maybeForget(l)
		}
		return
	}
	w.attempting = false
	switch {
	case granted:
		w.grantHeard = false
		l.chain = 0 // a normal acquisition ends any chain of local handoffs
		// The script counted the field the attempt named: a re-entry names its
		// hold's, which may be a direct grant's, and the hold may have ended
		// meanwhile (a grant taken back): the new hold keeps that field.
		w.grantedField = d.call.args[1]
		m.grant(w, d.sentAt, now)
	case d.err != nil:
		w.grantHeard = false // its next attempt claims a grant it heard of
		w.freshFailed = d.call.fresh && l.fair != nil && !isRedisError(d.err)
		if registered {
			w.registered = true // the script may have run: a leave then removes it
		}
		if h := m.holds[holdKey{l.id, w.owner}]; h != nil && !isRedisError(d.err) {
			m.reentryMayHaveRun(h, w.lease, d.sentAt, now)
		}
		m.attemptFailed(w, d.err, now)
	case l.fair != nil:
		m.fairRefused(w, time.Duration(d.reply.Int)*time.Millisecond, d.sentAt, now)
	case registered && m.onRegisteredAttempt(w, claimed, d.sentAt, now):
		// It took a direct grant.
	case claimed:
		// A grant it could not take went back; the release that frees the lock
		// publishes, and the retry timer covers the rest.
		m.attemptRefused(w, minBackoff, now)
	default:
		m.attemptRefused(w, time.Duration(d.reply.Int)*time.Millisecond, now)
	}
	m.advance(l, now)
	m.maybeForget(l)
}

func (m *machine) attemptFailed(w *waiter, err error, now time.Time) {
	l := w.lock
	if l.fair != nil && !isRedisError(err) {
		m.fairGrantsInDoubt(l, w.owner, w)
	}
	if isRedisError(err) || w.oneShot || w.expired || w.cancelErr != nil || m.closing {
		// A Redis error reply (wrong type, script error, no auth) will not go away by
		// retrying; a waiter out of time or cancelled gets its answer now. Its
		// attempt is still the owner's call in flight, so no other call of the
		// owner's can be: the cleanup goes now.
		if !isRedisError(err) {
			m.undoAmbiguous(w)
		}
		w.ambiguous = false
		if w.cancelErr != nil {
			err = w.cancelErr
		}
		m.finish(w, err)
		return
	}
	// A transport error: the server may come back. Keep the waiter, retry with backoff.
	// If it gives up meanwhile, finish cleans up what this attempt may have taken.
	w.lastErr = err
	w.ambiguous = true
	if l.fair == nil && w.sentField != "" && w.sentField != m.waiterField(w) && m.holds[holdKey{l.id, w.owner}] == nil {
		// A re-entry under a direct grant's field whose hold ended meanwhile: if
		// the script ran, that field holds the lock for nobody. Nobody else uses
		// it, so it goes (the retry names the handle's own field).
		m.abandon(l, w.owner, w.sentField, 0)
		w.ambiguous = false // what it may have taken is gone already
	}
	if w.freshFailed && m.holds[holdKey{l.id, w.owner}] == nil {
		// A fresh fair attempt (scripts.RunLoneFreshFair) may have created the
		// lock under the handle's field past a queue, its give-back not run. The
		// retry, the script claiming what it finds under that field, would keep
		// it ahead of the queue: the field goes first (lock_release_owner wakes
		// the queue's head), and the retry, which waits for that give-back
		// (fairAdvance: leaving), finds the lock as it is. A lock taken with
		// nobody queued goes back too, and the retry takes it again. The
		// waiter stays ambiguous: the commands' last step, fair_acquire, may
		// have queued it, and a waiter that gives up before its retry must
		// leave that entry (undoAmbiguous).
		m.abandon(l, w.owner, m.waiterField(w), 0)
	}
	w.freshFailed = false
	if l.fair != nil {
		w.wake = true // its own retry timer was spent on this attempt
	}
	switch {
	case l.fair != nil && !w.enqueued:
		// Local order must stay Redis queue order: behind those already in it.
		w.direct = false
		m.fairRequeue(w)
	case w.direct:
		// A re-entering holder must not queue behind waiters that wait for it.
		w.direct = false
		l.queue.pushFront(w)
	}
	l.backoff = min(max(2*l.backoff, minBackoff), maxBackoff)
	l.backingOff = true
	m.armRetry(l, l.backoff)
}

func (m *machine) attemptRefused(w *waiter, ttl time.Duration, now time.Time) {
	l := w.lock
	w.refused = true
	w.ambiguous = false // the server answered: an earlier attempt took nothing
	l.backoff = 0
	l.backingOff = false
	if m.settleRefusal(w) {
		return
	}
	if l.queue.head != w {
		return
	}
	if l.wakePending {
		return // advance retries at once
	}
	switch {
	case ttl == -2*time.Millisecond: // the key vanished between the checks: advance retries at once
		m.subscribe(l)
		return
	case ttl < 0: // exists without an expiry
		ttl = noTTLRetry
	}
	m.park(l, ttl, now)
}

// grant records a hold for w and completes its future.
func (m *machine) grant(w *waiter, sentAt, now time.Time) {
	l := w.lock
	l.wakePending = false
	if w.queued {
		l.queue.remove(w)
	}
	delete(m.waiters, w.id)
	m.cancelWait(w)
	w.enqueued = false // the script took it out of the Redis queue
	m.disarm(kindFairRetry, w.id, &w.retryGen)
	field := w.grantedField
	if field == "" {
		field = m.waiterField(w)
	}
	h := m.addHold(l, w.owner, field, w.lease, sentAt, now)
	m.stats.Grants++
	if w.ambiguous {
		// An earlier attempt may have run: this grant may have re-entered its count.
		h.maySurplus = true
		w.ambiguous = false
	}
	if l.fair != nil && h.count == 1 {
		m.ownerEntryTaken(l, w.owner)
	}

	err := w.cancelErr
	if err == nil {
		err = w.ctx.Err()
	}
	if err != nil {
		// The caller's context ended before the grant: it gets the context's error,
		// and the grant goes back at once.
		if w.stop != nil {
			w.stop()
		}
		w.future.Complete(WrapError(l.name, err))
		m.releaseOne(h, false)
		if l.queue.len == 0 {
			m.queueEmptied(l)
		}
		return
	}
	m.deliver(w.future)
	if w.stop != nil {
		// The caller may still walk away without receiving (a select that took
		// another case, then cancelled): keep watching its context until the hold
		// ends, and take the grant back if it is still unreceived then.
		m.pruneReceipts(h)
		r := &receipt{id: w.id, future: w.future, stop: w.stop, hold: h.id, ctx: w.ctx}
		m.receipts[r.id] = r
		h.receipts = append(h.receipts, r.id)
	}
	switch {
	case l.queue.len == 0:
		m.queueEmptied(l)
	case l.fair == nil:
		m.park(l, m.leaseOf(w.lease), now)
	}
}

// settleRefusal answers a refused waiter that cannot wait any more (cancelled, a
// single try, out of time) and reports whether it did. A holder whose re-entry was
// refused has lost the lock on the server (expired, deleted, force-released
// elsewhere): its stale hold ends, and it waits like anyone else.
func (m *machine) settleRefusal(w *waiter) bool {
	switch {
	case w.cancelErr != nil:
		m.finish(w, w.cancelErr)
		return true
	case w.oneShot || w.expired:
		m.finish(w, ErrNotAcquired)
		return true
	}
	if w.direct {
		w.direct = false
		m.loseStaleHold(w.lock, w.owner)
		if w.lock.fair != nil && w.enqueued {
			m.fairRequeue(w) // it just joined the Redis queue's tail
		} else {
			w.lock.queue.push(w)
		}
	}
	return false
}

// undoAmbiguous follows an acquire that failed with a transport error, and that the
// waiter gives up on, with an owner-guarded cleanup: the script may have run before
// the connection failed, granting the lock (or, for a fair lock, queueing the owner)
// with nobody to know it. Both cleanups do nothing if it did not run. An owner that
// holds the lock already is left alone: a surplus count is released at its last
// Unlock (see dropSurplus).
func (m *machine) undoAmbiguous(w *waiter) {
	l := w.lock
	if h := m.holds[holdKey{l.id, w.owner}]; h != nil {
		h.maySurplus = true // the attempt was a re-entry of it
		return
	}
	switch {
	case l.fair != nil && !w.oneShot:
		// finish sends the leave, which also gives back a hold the attempt may
		// have taken (its claim flag is "1": this client holds nothing).
		w.enqueued = true
	case l.fair != nil && m.ownerEnqueued(l, w.owner):
		// The owner's field may be a direct grant to its queued waiter: leave it.
		// A count the single try may have added goes at that hold's last Unlock
		// (see dropSurplus).
	default:
		field := m.waiterField(w)
		if l.fair == nil && w.sentField != "" {
			field = w.sentField // a re-entry's: its hold's field, maybe a direct grant's
		}
		m.abandon(l, w.owner, field, 0)
	}
}

// reentryMayHaveRun: an acquire of h's owner, with lease (0: the watchdog), failed
// in transit while h held, so it may have run as a re-entry, which set the lock's
// expiry to that lease from when it ran (no earlier than sentAt). When that is
// sooner than h's expiry (a TryLock with a short lease on a handle that holds
// under the watchdog, say), the hold may run out then: its expiry is brought
// forward, with the margin of the shorter lease, so Lost closes before then
// unless a renewal comes first. The hold's lease is then in doubt (leaseDoubts)
// until a renewal sent after now confirms it: a renewal sent earlier may have run
// before this call, so its reply is not trusted (onRenewDone), and a watchdog
// hold is renewed at once, or when the renewal in flight answers (renewDoubted).
// The same holds when the call's lease is not shorter
// but a renewal is in flight or the lease already in doubt: its expiry is kept,
// and the doubt starts again from now. A hold with an explicit lease is not
// renewed: it is told it is lost early rather than late.
func (m *machine) reentryMayHaveRun(h *hold, lease time.Duration, sentAt, now time.Time) {
	lease = m.leaseOf(lease)
	at := sentAt.Add(lease)
	d, doubted := m.leaseDoubts[h.id]
	if !at.Before(h.expiresAt) && !doubted && !h.renewing && h.reentryLease == 0 {
		return // the expiry it could set is no sooner, and nothing in flight can hide it
	}
	if at.Before(h.expiresAt) {
		h.expiresAt = at
	}
	if doubted {
		lease = min(lease, d.lease)
	}
	m.leaseDoubts[h.id] = leaseDoubt{since: now, lease: lease}
	h.reentryLease = 0 // the doubt's lease is the margin's now
	m.armExpiry(h, now)
	m.renewDoubted(h)
}

// leaseDoubt is a hold's entry in machine.leaseDoubts.
type leaseDoubt struct {
	since time.Time     // when the failed call was heard of: renewals sent before are not trusted
	lease time.Duration // the shortest lease such a call carried: its margin is the hold's
}

// renewDoubted renews h's hold now if its lease is in doubt and it is a watchdog
// hold with no renewal in flight, whether or not its owner has a call in flight:
// a doubted hold takes a "held" reply even then (onRenewDone), and waiting for the
// owner to be idle could outlast the shortened expiry.
func (m *machine) renewDoubted(h *hold) {
	if _, ok := m.leaseDoubts[h.id]; !ok || h.lease != 0 || h.renewing || h.provisional {
		return
	}
	m.renew([]*hold{h})
}

// loseStaleHold ends the owner's local hold after Redis showed it is gone.
func (m *machine) loseStaleHold(l *lockState, owner uint64) {
	if h := m.holds[holdKey{l.id, owner}]; h != nil {
		m.loseHold(h, false)
	}
}

// queueEmptied: the lock's last local waiter is gone. Nothing needs its retry timer
// now, and its subscription lingers briefly, then goes.
func (m *machine) queueEmptied(l *lockState) {
	l.backingOff = false // the back-off belonged to a waiter that is gone
	l.parked = false
	l.wakePending = false
	m.disarmRetry(l)
	m.lingerOrUnsubscribe(l)
}

// finish completes a waiter that did not get the lock.
func (m *machine) finish(w *waiter, err error) {
	l := w.lock
	if w.ambiguous {
		// Its last attempt may have run: a waiter that gives up during the back-off
		// after a transport error (its context, its wait, Close) must not leave
		// the lock held by nobody until its lease ends. Unless another call of the
		// owner's is in flight (a TryLock of the same handle, a handoff to
		// another of its waiters): the owner-guarded cleanup could run after it
		// and delete the hold it takes, so then the lock ends with its lease, as
		// it did before this cleanup existed. (A refused handoff to w itself is
		// not another call: see handoffRefused. Nor is the call whose reply is
		// being read, ownCalls: a walked-away waiter whose attempt's reply was
		// lost is pruned by the advance that follows that very reply.)
		w.ambiguous = false
		if k := (holdKey{l.id, w.owner}); !m.ownerBusy(k) || m.serial[k].busy <= m.ownCalls(k) {
			m.undoAmbiguous(w)
		} else if l.fair != nil && !w.oneShot && m.holds[k] == nil {
			// A fair join that may have queued the owner: its entry must leave the
			// Redis queue, or once at its head it keeps every process out for its
			// lease or the wait allowance. The leave waits for the owner's call in
			// flight, and claims only if that call took nothing (fairLeaveOwner).
			w.enqueued = true
		} else if h := m.holds[k]; h != nil {
			h.maySurplus = true
		}
	}
	if w.queued {
		l.queue.remove(w)
	}
	delete(m.waiters, w.id)
	m.cancelWait(w)
	if w.enqueued {
		m.fairLeave(w)
	}
	if w.registered {
		m.leaveRegistration(w)
	}
	if w.stop != nil {
		w.stop()
	}
	if err == ErrNotAcquired && w.lastErr != nil {
		err = w.lastErr
	}
	w.future.Complete(WrapError(l.name, err))
	if l.queue.len == 0 {
		m.queueEmptied(l)
	}
}

func (m *machine) cancelWait(w *waiter) {
	if !w.deadline.IsZero() {
		m.cancelTimer(timer.Key{Kind: kindWait, ID: w.id})
	}
}

// complete answers a request that never became a waiter.
func (m *machine) complete(f *futures.Future[error], stop func() bool, err error) {
	if stop != nil {
		stop()
	}
	f.Complete(err)
}

// onCancel: a waiter's context ended. A waiter still queued leaves at once; one
// whose attempt is in flight is answered when the reply comes; a grant already sent
// is taken back if nobody received it.
func (m *machine) onCancel(msg cancelMsg, now time.Time) {
	if w := m.waiters[msg.id]; w != nil {
		if w.attempting {
			w.cancelErr = msg.err
			return
		}
		l := w.lock
		m.finish(w, msg.err)
		m.advance(l, now)
		m.maybeForget(l)
		return
	}
	if m.cancelParked(msg) {
		return
	}
	if r := m.receipts[msg.id]; r != nil {
		m.takeBack(r, msg.err)
	}
}

// takeBack takes back r's grant if its caller has not received it: the caller's
// context ended with err.
func (m *machine) takeBack(r *receipt, err error) {
	if !r.future.IsCompleted() {
		return // a grant deliver deferred to the end of this step: not received, and kept
	}
	delete(m.receipts, r.id)
	h := m.holdByID[r.hold]
	if _, revoked := r.future.Revoke(err); revoked && h != nil {
		m.stats.Revoked++
		m.releaseOne(h, true)
	}
}

// takeBackWalkedAway takes back, now, the grants to the owner's hold on l that
// their callers have not received and whose contexts have ended: the caller of
// Acquire that took its context's end instead has returned, and a HoldCount after
// it must not count that grant, whose cancellation message (context.AfterFunc's
// goroutine) may come later.
func (m *machine) takeBackWalkedAway(l *lockState, owner uint64) {
	h := m.holds[holdKey{l.id, owner}]
	if h == nil {
		return
	}
	for _, id := range slices.Clone(h.receipts) {
		if r := m.receipts[id]; r != nil && r.ctx.Err() != nil {
			m.takeBack(r, r.ctx.Err())
		}
	}
}

// cancelWalkedAway handles now the cancellation of the owner's waiters on l whose
// contexts have ended: an Acquire caller that took its context's end has returned,
// and a HoldCount after it must wait for what its waiter's cancellation sends (a
// fair waiter's leave, which gives back a grant made to it by another process's
// release and not heard of yet), not count that grant; its cancellation message
// (context.AfterFunc's goroutine) may come later, and then finds nothing to do.
// It walks l's queue: HoldCount, its one caller, is not a hot path.
func (m *machine) cancelWalkedAway(l *lockState, owner uint64, now time.Time) {
	var gone []uint64
	for w := l.queue.head; w != nil; w = w.next {
		if w.owner == owner && w.cancelErr == nil && w.ctx.Err() != nil {
			gone = append(gone, w.id)
		}
	}
	for _, id := range gone {
		if w := m.waiters[id]; w != nil {
			m.onCancel(cancelMsg{id: id, err: w.ctx.Err()}, now)
		}
	}
}

// onUnlockNotice: one unlock message is one permit for the head waiter to retry.
func (m *machine) onUnlockNotice(channel, payload string, now time.Time) {
	if channel == m.grantChannel {
		m.onGrantMessage(payload, now)
		return
	}
	l := m.lockByChannel[channel]
	if l == nil {
		m.fairNotice(channel, payload, now)
		return
	}
	if l.queue.head == nil || l.fair != nil {
		return
	}
	m.stats.Notices++
	if (l.queue.head.registered || m.yieldPending(l)) && m.yieldToPublic(l) {
		return // a head that need not race gives way; a pending yield takes the message
	}
	m.wakeHead(l, now)
}

// wakeHead makes a plain lock's head waiter retry: now, or, while a call that
// decides the lock is in flight, once it is answered.
func (m *machine) wakeHead(l *lockState, now time.Time) {
	if l.attempting != nil || l.handingOff {
		l.wakePending = true
		return
	}
	m.startAttempt(l, now)
}

// onResubscribed: messages may have been lost while the pub/sub connection was
// down, so the head waiter of every lock with waiters retries.
func (m *machine) onResubscribed(now time.Time) {
	clear(m.claimedGrants) // messages may have been lost: see noteClaimed
	for _, l := range m.locks {
		if l.queue.head == nil {
			continue
		}
		if l.fair != nil {
			m.fairWakeFirst(l, now)
			continue
		}
		m.wakeHead(l, now)
	}
}
