package engine

import (
	"slices"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
)

// Releasing: Unlock (with the direct local handoff), ForceUnlock, and Lost.

func (m *machine) onUnlock(msg unlockMsg, now time.Time) {
	if m.closing {
		msg.future.Complete(ErrClosed)
		return
	}
	var h *hold
	l := m.locks[msg.lock]
	if l != nil {
		key := holdKey{l.id, msg.owner}
		if m.deferIfBusy(key, msg) {
			return
		}
		h = m.holds[key]
	}
	if h == nil {
		err := ErrNotHeld
		if l != nil {
			if _, lost := m.lostHolds[holdKey{l.id, msg.owner}]; lost {
				delete(m.lostHolds, holdKey{l.id, msg.owner})
				err = errHoldLost
			}
		}
		msg.future.Complete(err)
		return
	}
	m.markBusy(holdKey{l.id, msg.owner})
	if w := m.handoffTarget(l, h, now); w != nil {
		m.handoff(l, h, w, msg.future, now)
		return
	}
	call := scriptCall{
		script:  scripts.LockRelease,
		keys:    l.releaseKeys,
		args:    []string{unlockMessage, m.leaseText(h.lease), h.field},
		purpose: purposeUnlock,
		lock:    l.id,
		hold:    h.id,
		unlock:  msg.future,
		owner:   h.owner,
		serial:  true,
	}
	if l.fair != nil {
		call.script = scripts.FairRelease
		call.keys = l.fair.keys
		call.args = append(call.args, wallMillis(now), millis(m.cfg.fairWait))
	}
	m.run(call)
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
	call := scriptCall{
		script:   scripts.LockHandoff,
		keys:     l.releaseKeys,
		args:     []string{h.field, m.leaseText(h.lease), ownerField(m.cfg.clientID, w.owner), m.leaseText(w.lease), bound, unlockMessage},
		purpose:  purposeHandoff,
		lock:     l.id,
		waiter:   w.id,
		receiver: w.owner,
		hold:     h.id,
		unlock:   future,
		owner:    h.owner,
		serial:   true,
	}
	if l.fair != nil {
		// No bound: the fair script hands over only to the Redis queue's head.
		call.script = scripts.FairHandoff
		call.keys = l.fair.keys
		call.args = []string{h.field, m.leaseText(h.lease), ownerField(m.cfg.clientID, w.owner), m.leaseText(w.lease),
			millis(m.cfg.fairWait), wallMillis(now), unlockMessage}
	}
	m.run(call)
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
		d.call.unlock.Complete(m.unlockFoundLost(h))
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
			m.abandon(l, d.call.receiver, 1)
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
		d.call.unlock.Complete(m.unlockFoundLost(h))
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
			keys:    l.fair.keys,
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
			// Holds granted after the force-release was sent are not its victims: its
			// own unlock message may have woken a waiter that got the lock since.
			for _, h := range slices.Clone(l.holders) {
				if !h.grantedAt.After(d.sentAt) {
					m.loseHold(h, false)
				}
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

// unlockFoundLost ends a hold whose Unlock found the owner's field gone, and returns
// the Unlock's answer: ErrNotHeld, and ErrLockLost when a local hold was lost.
func (m *machine) unlockFoundLost(h *hold) error {
	if h == nil {
		return ErrNotHeld
	}
	m.loseHold(h, false)
	delete(m.lostHolds, holdKey{h.lock.id, h.owner}) // answered here
	return errHoldLost
}
