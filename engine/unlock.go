package engine

import (
	"slices"
	"strconv"
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
	l := m.locks[msg.lock]
	if l == nil {
		msg.future.Complete(ErrNotHeld)
		return
	}
	key := holdKey{l.id, msg.owner}
	h := m.holds[key]
	switch {
	case h == nil:
		// Nothing to release, now or later: the answer waits for nothing.
		err := m.unlockFoundLost(key, nil) // ErrLockLost if the hold was lost
		if msg.hold != 0 {
			err = errHoldLost // its hold ended while it waited (see below)
		}
		msg.future.Complete(err)
		return
	case msg.hold == 0:
		// An Unlock releases the hold its caller was granted, which is the owner's
		// hold when it arrives. Bound to it, it cannot release a hold granted
		// while it waits below (a Lock of another goroutine sharing the handle):
		// that goroutine would then be inside with no lock on the server.
		msg.hold = h.id // set before msg is copied into a parked entry
	case msg.hold != h.id:
		// Its hold ended while it waited (lost, or its count released by another
		// Unlock of the handle), and this one is another's.
		msg.future.Complete(errHoldLost)
		return
	}
	if m.relayUnlock(l, msg, now) {
		return
	}
	if m.ownerBusy(key) {
		msg.giveBacksBefore = 0 // its bound is set once it gets past the call (waitFrom)
		m.deferCall(key, msg)
		return
	}
	before := m.waitFrom(&msg.giveBacksBefore) // set before msg is copied into a parked entry
	if m.heldUpByGiveBacks(key, before) {
		m.deferForGiveBacks(key, msg, before)
		return
	}
	m.markBusy(holdKey{l.id, msg.owner})
	if w := m.handoffTarget(l, h); w != nil {
		m.handoff(l, h, w, msg.future, now)
		return
	}
	call := scriptCall{
		script: scripts.LockRelease,
		keys:   l.releaseKeys,
		// Room for either kind's further arguments, so appending does not copy.
		args:    append(make([]string, 0, 7), unlockMessage, m.leaseText(h.lease), h.field),
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
		call.args = append(call.args, wallMillis(now), m.fairWaitText)
		call.quiet = quietRelease(l, h, "0")
	} else {
		// Direct grants (directgrant.go): the release skips this client's own
		// registration, and drops it when no local waiter is left.
		dereg := "0"
		if l.queue.len == 0 && l.mayBeRegistered {
			dereg = "1"
			l.mayBeRegistered = false
		}
		call.args = append(call.args, m.cfg.clientID, selfListens(l), dereg)
		call.quiet = quietRelease(l, h, dereg)
	}
	if h.count > 1 {
		// The count h keeps: a release whose reply was lost is sent again
		// (retryOnce), and the script must not then take a second count, which
		// would free a lock its owner still holds. At this count or below the
		// release has run, and takes nothing.
		call.args = append(call.args, strconv.Itoa(h.count-1))
	}
	m.run(call)
}

// quietRelease reports whether the release of h's last count on l may go as
// two plain commands (scriptCall.quiet): h is l's only hold here, at one count
// the server counts too, nobody here waits for l or listens on its channel, the
// release drops no registration, and the lock's last release found nobody
// listening (a plain lock) or nobody queued (a fair lock): its reply was 2.
//
// For the plain lock, the script's direct grant then has nobody to go to unless
// another client's waiter registered since; that waiter takes the unlock
// message instead, and the reply (1: somebody heard it) sends the next release
// back to the script. For the fair lock, a queue found by the pair is passed on
// by the script after all, a round trip later (scripts.QuietReleaser).
func quietRelease(l *lockState, h *hold, dereg string) bool {
	return l.quietLast && h.count == 1 && !h.maySurplus && !h.provisional && len(l.holders) == 1 &&
		l.queue.len == 0 && l.sub == subNone && dereg == "0"
}

func (m *machine) onUnlockDone(d scriptDone, now time.Time) {
	h := m.holdByID[d.call.hold]
	l := m.lockByID[d.call.lock]
	if m.retryOnce(d) {
		return
	}
	if l != nil && (d.err != nil || d.reply.Nil || d.reply.Int != 0) {
		// A release that kept a count (0) says nothing of who listens.
		l.quietLast = d.err == nil && !d.reply.Nil && d.reply.Int == 2
	}
	switch {
	case d.err != nil:
		// Tried twice: whether it ran is unknown, so the hold counts as lost (not
		// renewed, its Lost closed) and its field is released owner-guarded once
		// more; at worst the lock ends with its lease. Whether it dropped this
		// client's registration is unknown too: it may still be there.
		if h != nil {
			m.loseHold(h, true)
		}
		if l != nil && l.fair == nil && len(d.call.args) > 5 && d.call.args[5] == "1" {
			l.mayBeRegistered = true
		}
		d.call.unlock.Complete(d.err)
	case d.reply.Nil && d.call.retried && !d.call.firstUnrun:
		// The first try most likely ran before its connection failed: the lock is
		// no longer this owner's, which is what Unlock asked for. With more counts,
		// though, the first try kept h.count-1 (its bound) and cannot have deleted
		// the field: something else did (a force-release), and took the counts
		// the hold keeps: it is lost (its Lost closes; its next Unlock says so).
		switch {
		case h != nil && h.count > 1:
			m.loseHold(h, false)
		case h != nil:
			m.dropHold(h)
		}
		d.call.unlock.Complete(nil)
	case d.reply.Nil: // the owner's field is gone: the lease ran out, or a force-release
		d.call.unlock.Complete(m.unlockFoundLost(holdKey{d.call.lock, d.call.owner}, h))
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
			// 2: nobody else listened, so nothing was published. 1: the unlock
			// message may have come before this reply, when no local waiter was
			// there to hear it, and a waiter that came since parked behind the
			// local hold. Either way this client's head, if any, tries now (or
			// when a pending yield ends: see yieldToPublic). A fair release
			// grants the queue's head itself, and tells it (fair.go).
			if l.fair == nil || d.reply.Int == 2 {
				m.mayBeFree(l)
			}
		}
		d.call.unlock.Complete(nil)
	}
	if l != nil {
		m.advance(l, now)
		m.maybeForget(l)
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
		if l != nil && !isRedisError(d.err) {
			// It may have run, and deleted any of the holds: each is checked (a
			// provisional one once its handoff is confirmed, see confirmEarly), as
			// is a grant whose call is in flight (addHold).
			for _, h := range slices.Clone(l.holders) {
				if !h.provisional {
					m.checkForced(h)
				}
			}
			l.forcedAt = now
		}
		d.call.force.Complete(forceResult{err: d.err})
	} else {
		if l != nil {
			// When it found the lock held, holds granted before the force-release
			// was sent are its victims. One granted by a call sent after it may be
			// too: calls on different connections need not run in the order they
			// were sent. Or it may not (the force-release's own unlock message may
			// have woken a waiter that got the lock since): checkForced asks. So
			// does addHold for a grant whose call was in flight at this reply.
			// When it found no lock it deleted nothing: a hold granted before its
			// send either ran after it (sent on another connection) and stands, or
			// was gone before it (its lease ran out); checkForced asks.
			existed := d.reply.Int == 1
			for _, h := range slices.Clone(l.holders) {
				switch {
				case existed && !h.grantedAt.After(d.sentAt):
					m.loseHold(h, false)
				case h.provisional:
				case existed || !h.grantedAt.After(d.sentAt):
					m.checkForced(h)
				}
			}
			if existed {
				l.forcedAt = now
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
			msg.future.Complete(h.lostSignal().C())
			return
		}
	}
	msg.future.Complete(futures.FiredC())
}

// unlockFoundLost ends a hold whose Unlock found the owner's field gone, and returns
// the Unlock's answer: ErrNotHeld, and ErrLockLost when a local hold was lost (h,
// or one already dropped as lost: a force-release, an expiry while the call was in
// flight).
func (m *machine) unlockFoundLost(k holdKey, h *hold) error {
	if h != nil {
		m.loseHold(h, false)
	}
	if _, lost := m.lostHolds[k]; !lost {
		return ErrNotHeld
	}
	delete(m.lostHolds, k) // answered here
	return errHoldLost
}
