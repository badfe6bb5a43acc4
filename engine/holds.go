package engine

import (
	"strconv"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// holdKey names an owner's hold on one lock.
type holdKey struct{ lock, owner uint64 }

// hold is a lock this process holds for one owner (a handle), with its local mirror
// of the hold count and the deadline before which the lease cannot have expired.
//
// A hold has no goroutine and no time.Timer: its lease deadline is one entry on the
// timing wheel, and its renewals are batched by the watchdog sweep.
type hold struct {
	id    uint64
	lock  *lockState
	owner uint64
	field string
	count int
	lease time.Duration // explicit lease; 0: renewed by the watchdog

	// expiresAt is when the lease could run out on the server: the send time of the
	// last successful acquire or renewal plus the lease, on the monotonic clock. The
	// server received the call after it was sent, so its expiry is no earlier.
	expiresAt time.Time
	nextRenew time.Time // watchdog holds: when the next renewal is due
	renewing  bool      // a renewal of this hold is in flight

	lost     *futures.Signal
	receipts []uint64 // grants still watched for an unreceived take-back
}

func (m *machine) holdsOf(l *lockState) []*hold { return l.holders }

// addHold records a grant: a new hold, or one more count on the owner's hold.
func (m *machine) addHold(l *lockState, owner uint64, lease time.Duration, sentAt, now time.Time) *hold {
	key := holdKey{l.id, owner}
	h := m.holds[key]
	if h == nil {
		m.nextID++
		h = &hold{id: m.nextID, lock: l, owner: owner, field: ownerField(m.cfg.clientID, owner), lease: -1, lost: futures.NewSignal()}
		m.holds[key] = h
		m.holdByID[h.id] = h
		l.holders = append(l.holders, h)
	}
	h.count++
	// The acquire script re-applied the expiry with this call's lease, so the hold
	// now follows it: an explicit lease, or the watchdog.
	if h.lease != 0 && lease == 0 {
		m.watchdogHolds++
	} else if h.lease == 0 && lease != 0 {
		m.watchdogHolds--
	}
	h.lease = lease
	h.expiresAt = sentAt.Add(m.leaseOf(lease))
	if lease == 0 {
		h.nextRenew = sentAt.Add(m.cfg.watchdog / 3)
		m.armSweep()
	}
	m.armExpiry(h, now)
	return h
}

// expiryMargin is how long before expiresAt a hold is declared lost, so Lost closes
// before the lease could have run out on the server even if the wheel fires late:
// 2% of the lease, at least 2 ms and at most 500 ms.
func expiryMargin(lease time.Duration) time.Duration {
	return min(max(lease/50, 2*time.Millisecond), 500*time.Millisecond)
}

func (m *machine) armExpiry(h *hold, now time.Time) {
	d := h.expiresAt.Add(-expiryMargin(m.leaseOf(h.lease))).Sub(now)
	m.schedule(timer.Key{Kind: kindExpiry, ID: h.id}, d)
}

func (m *machine) onExpiry(id uint64, now time.Time) {
	h := m.holdByID[id]
	if h == nil {
		return
	}
	deadline := h.expiresAt.Add(-expiryMargin(m.leaseOf(h.lease)))
	if left := deadline.Sub(now); left > timer.Tick {
		m.schedule(timer.Key{Kind: kindExpiry, ID: id}, left) // early, or renewed since
		return
	}
	l := h.lock
	m.loseHold(h, true)
	m.advance(l, now)
	m.maybeForget(l)
}

// loseHold ends a hold that was not unlocked: its Lost signal closes. With release,
// the owner's field is deleted on the server if it is still there (owner-guarded), so
// a lock we told the holder it lost does not linger until its lease ends.
func (m *machine) loseHold(h *hold, release bool) {
	m.mayBeFree(h.lock)
	h.lost.Fire()
	if release {
		m.abandon(h.lock, h.field, 0)
	}
	m.dropHold(h)
}

// pruneReceipts stops watching grants of h that have been received (a received
// grant is never taken back), so a long-held, often re-entered lock does not
// accumulate context registrations.
func (m *machine) pruneReceipts(h *hold) {
	kept := h.receipts[:0]
	for _, id := range h.receipts {
		r := m.receipts[id]
		if r == nil {
			continue
		}
		if len(r.future.C()) == 0 { // received
			r.stop()
			delete(m.receipts, id)
			continue
		}
		kept = append(kept, id)
	}
	h.receipts = kept
}

// dropHold forgets a hold.
func (m *machine) dropHold(h *hold) {
	l := h.lock
	delete(m.holds, holdKey{l.id, h.owner})
	delete(m.holdByID, h.id)
	for i, x := range l.holders {
		if x == h {
			l.holders = append(l.holders[:i], l.holders[i+1:]...)
			break
		}
	}
	if h.lease == 0 {
		m.watchdogHolds--
	}
	m.cancelTimer(timer.Key{Kind: kindExpiry, ID: h.id})
	for _, id := range h.receipts {
		if r := m.receipts[id]; r != nil {
			r.stop()
			delete(m.receipts, id)
		}
	}
	h.receipts = nil
}

// dropSurplus ends a hold whose last local count was released while the server
// still counts more: an acquire whose reply was lost to a transport error may have
// run, and its retry then counted twice. Nobody owns the surplus, so it goes.
func (m *machine) dropSurplus(h *hold) {
	l := h.lock
	m.dropHold(h)
	m.abandon(l, h.field, 0)
}

// releaseOne gives back one count of h: a grant nobody received.
func (m *machine) releaseOne(h *hold) {
	h.count--
	m.abandon(h.lock, h.field, 1)
	if h.count <= 0 {
		m.dropHold(h)
	}
}

// abandon runs the owner-guarded release of drop holds (0: all) of field.
func (m *machine) abandon(l *lockState, field string, drop int) {
	keys := []string{l.name, l.channel}
	if l.fair != nil {
		keys = append(keys, l.fair.queue)
	}
	m.run(scriptCall{
		script:  scripts.LockReleaseOwner,
		keys:    keys,
		args:    []string{unlockMessage, field, strconv.Itoa(drop)},
		purpose: purposeAbandon,
		lock:    l.id,
	})
}

// ---- unlock ----

func (m *machine) onUnlock(msg unlockMsg, now time.Time) {
	if m.closing {
		msg.future.Complete(ErrClosed)
		return
	}
	var h *hold
	l := m.locks[msg.lock]
	if l != nil {
		h = m.holds[holdKey{l.id, msg.owner}]
	}
	if h == nil {
		msg.future.Complete(ErrNotHeld)
		return
	}
	if w := m.handoffTarget(l, h, now); w != nil {
		m.handoff(l, h, w, msg.future, now)
		return
	}
	if l.fair != nil {
		m.run(scriptCall{
			script:  scripts.FairRelease,
			keys:    []string{l.name, l.fair.queue, l.fair.timeout, l.channel},
			args:    []string{unlockMessage, millis(m.leaseOf(h.lease)), h.field, wallMillis(now)},
			purpose: purposeUnlock,
			lock:    l.id,
			hold:    h.id,
			unlock:  msg.future,
		})
		return
	}
	m.run(scriptCall{
		script:  scripts.LockRelease,
		keys:    []string{l.name, l.channel},
		args:    []string{unlockMessage, millis(m.leaseOf(h.lease)), h.field},
		purpose: purposeUnlock,
		lock:    l.id,
		hold:    h.id,
		unlock:  msg.future,
	})
}

// handoffTarget returns the local waiter that h's release may hand the lock to
// directly, or nil.
//
// Why a bound: a direct handoff never frees the lock, so waiters in other processes
// never see a release. Like sync.Mutex's starvation mode, once a chain of local
// handoffs reaches cfg.handoffChain handoffs or cfg.handoffAge, whichever comes
// first, the handoff script releases the lock to everyone instead, if anyone besides
// this client listens on the unlock channel; this process's head then competes with
// the other processes' heads on the same unlock message. When nobody else listens,
// nobody else is waiting to be woken, and the chain goes on.
func (m *machine) handoffTarget(l *lockState, h *hold, now time.Time) *waiter {
	m.pruneCancelled(l)
	w := l.queue.head
	if w == nil || h.count != 1 || l.attempting != nil || len(l.holders) != 1 || m.cfg.handoffChain <= 0 {
		return nil
	}
	if l.fair != nil {
		// The script hands over only if w heads the Redis queue, so FIFO across
		// processes holds without a bound.
		if !w.enqueued {
			return nil
		}
		return w
	}
	return w
}

// chainBound reports whether l's chain of local handoffs has reached its bound.
func (m *machine) chainBound(l *lockState, now time.Time) bool {
	return l.chain > 0 && (l.chain >= m.cfg.handoffChain || now.Sub(l.chainStart) >= m.cfg.handoffAge)
}

func (m *machine) handoff(l *lockState, h *hold, w *waiter, future *futures.Future[error], now time.Time) {
	bound := "0"
	if m.chainBound(l, now) {
		bound = "1"
	}
	if l.chain == 0 {
		l.chainStart = now
	}
	l.chain++
	l.attempting = w
	l.wakePending = false
	w.attempting = true
	if l.fair != nil {
		m.run(scriptCall{
			script: scripts.FairHandoff,
			keys:   []string{l.name, l.fair.queue, l.fair.timeout, l.channel},
			args: []string{h.field, millis(m.leaseOf(h.lease)), ownerField(m.cfg.clientID, w.owner), millis(m.leaseOf(w.lease)),
				millis(m.cfg.fairWait), wallMillis(now), unlockMessage},
			purpose: purposeHandoff,
			lock:    l.id,
			waiter:  w.id,
			hold:    h.id,
			unlock:  future,
		})
		return
	}
	m.run(scriptCall{
		script:  scripts.LockHandoff,
		keys:    []string{l.name, l.channel},
		args:    []string{h.field, millis(m.leaseOf(h.lease)), ownerField(m.cfg.clientID, w.owner), millis(m.leaseOf(w.lease)), bound, unlockMessage},
		purpose: purposeHandoff,
		lock:    l.id,
		waiter:  w.id,
		hold:    h.id,
		unlock:  future,
	})
}

func (m *machine) onUnlockDone(d scriptDone, now time.Time) {
	h := m.holdByID[d.call.hold]
	l := m.lockByID[d.call.lock]
	if m.retryOnce(d) {
		return
	}
	switch {
	case d.err != nil:
		d.call.unlock.Complete(d.err)
	case d.reply.Nil && d.call.retried:
		// The first try most likely ran before its connection failed: the lock is
		// no longer this owner's, which is what Unlock asked for.
		if h != nil {
			m.dropHold(h)
		}
		d.call.unlock.Complete(nil)
	case d.reply.Nil: // the owner's field is gone: the lease ran out, or a force-release
		if h != nil {
			m.loseHold(h, false)
		}
		d.call.unlock.Complete(ErrNotHeld)
	case d.reply.Int == 0: // still held, one count less
		if h != nil && h.count > 1 {
			h.count--
		} else if h != nil {
			m.dropSurplus(h)
		}
		d.call.unlock.Complete(nil)
	default: // released to everyone; the unlock message wakes the heads
		if h != nil {
			m.dropHold(h)
		}
		if l != nil {
			l.chain = 0
		}
		d.call.unlock.Complete(nil)
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

func (m *machine) onHandoffDone(d scriptDone, now time.Time) {
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
		d.call.unlock.Complete(d.err)
		if w != nil {
			m.attemptFailed(w, d.err, now)
		}
	case d.reply.Int == 2: // handed over
		if h != nil {
			m.dropHold(h)
		}
		d.call.unlock.Complete(nil)
		m.stats.Handoffs++
		if w != nil {
			m.grant(w, d.sentAt, now)
		} else if l != nil {
			m.abandon(l, d.call.args[2], 1)
		}
	case d.reply.Int == 1: // released to everyone (chain bound), or to a fair waiter ahead in the queue
		if h != nil {
			m.dropHold(h)
		}
		if l != nil {
			l.chain = 0
		}
		d.call.unlock.Complete(nil)
		m.handoffRefused(w)
	case d.reply.Nil: // the releasing owner had lost the lock: the waiter retries normally
		if h != nil {
			m.loseHold(h, false)
		}
		d.call.unlock.Complete(ErrNotHeld)
		m.handoffRefused(w)
	default: // the releasing owner still holds it
		if h != nil && h.count > 1 {
			h.count--
		} else if h != nil {
			m.dropSurplus(h)
		}
		d.call.unlock.Complete(nil)
		m.handoffRefused(w)
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

// handoffRefused answers a waiter whose handoff did not happen if it was cancelled
// or ran out of time meanwhile; otherwise it stays at the head.
func (m *machine) handoffRefused(w *waiter) {
	switch {
	case w == nil:
	case w.cancelErr != nil:
		m.finish(w, w.cancelErr)
	case w.expired:
		m.finish(w, ErrNotAcquired)
	}
}

// ---- force unlock, Lost ----

func (m *machine) onForceUnlock(msg forceUnlockMsg, now time.Time) {
	if m.closing {
		msg.future.Complete(forceResult{err: ErrClosed})
		return
	}
	l := m.lockFor(msg.lock, msg.fair)
	if (l.fair != nil) != msg.fair {
		msg.future.Complete(forceResult{err: errKindMismatch})
		m.maybeForget(l)
		return
	}
	if l.fair != nil {
		m.run(scriptCall{
			script:  scripts.FairForceRelease,
			keys:    []string{l.name, l.fair.queue, l.fair.timeout, l.channel},
			args:    []string{unlockMessage, wallMillis(now)},
			purpose: purposeForce,
			lock:    l.id,
			force:   msg.future,
		})
		return
	}
	m.run(scriptCall{
		script:  scripts.LockForceRelease,
		keys:    []string{l.name, l.channel},
		args:    []string{unlockMessage},
		purpose: purposeForce,
		lock:    l.id,
		force:   msg.future,
	})
}

func (m *machine) onForceDone(d scriptDone, now time.Time) {
	l := m.lockByID[d.call.lock]
	if d.err != nil {
		d.call.force.Complete(forceResult{err: d.err})
	} else {
		if l != nil {
			for len(l.holders) > 0 {
				m.loseHold(l.holders[0], false)
			}
		}
		d.call.force.Complete(forceResult{existed: d.reply.Int == 1})
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
	}
}

func (m *machine) onLost(msg lostMsg) {
	if l := m.locks[msg.lock]; l != nil {
		if h := m.holds[holdKey{l.id, msg.owner}]; h != nil {
			msg.future.Complete(h.lost.C())
			return
		}
	}
	msg.future.Complete(futures.FiredC())
}

// ---- the watchdog ----

// armSweep arms the watchdog sweep while any hold is renewed by it. One wheel entry
// serves every hold: the sweep runs four times per renewal period and renews, in
// batches of renewBatch per script call, every hold due within the next quarter
// period. Holds acquired at different times thus fall into shared rounds, so N held
// locks cost about N/renewBatch calls per period, with no timer per hold.
func (m *machine) armSweep() {
	if m.sweepArmed || m.watchdogHolds == 0 || m.closing {
		return
	}
	m.sweepArmed = true
	m.schedule(timer.Key{Kind: kindSweep}, m.sweepInterval())
}

func (m *machine) sweepInterval() time.Duration { return m.cfg.watchdog / 12 }

func (m *machine) onSweep(now time.Time) {
	m.sweepArmed = false
	horizon := now.Add(m.sweepInterval())
	var batch []*hold
	for _, h := range m.holdByID {
		if h.lease != 0 || h.renewing || h.nextRenew.After(horizon) {
			continue
		}
		batch = append(batch, h)
		if len(batch) == renewBatch {
			m.renew(batch)
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		m.renew(batch)
	}
	m.armSweep()
}

func (m *machine) renew(batch []*hold) {
	keys := make([]string, len(batch))
	args := make([]string, 1, len(batch)+1)
	ids := make([]uint64, len(batch))
	args[0] = millis(m.cfg.watchdog)
	for i, h := range batch {
		h.renewing = true
		keys[i] = h.lock.name
		args = append(args, h.field)
		ids[i] = h.id
	}
	m.stats.Renewals += uint64(len(batch))
	m.run(scriptCall{script: scripts.LockRenew, keys: keys, args: args, purpose: purposeRenew, batch: ids})
}

func (m *machine) onRenewDone(d scriptDone, now time.Time) {
	for i, id := range d.call.batch {
		h := m.holdByID[id]
		if h == nil {
			continue
		}
		h.renewing = false
		if d.err != nil || h.lease != 0 {
			continue // the next sweep retries; the expiry entry guards the deadline
		}
		if i < len(d.reply.Ints) && d.reply.Ints[i] == 1 {
			h.expiresAt = d.sentAt.Add(m.cfg.watchdog)
			h.nextRenew = d.sentAt.Add(m.cfg.watchdog / 3)
			m.armExpiry(h, now)
			continue
		}
		l := h.lock
		m.loseHold(h, false)
		m.advance(l, now)
		m.maybeForget(l)
	}
}
