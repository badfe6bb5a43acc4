package engine

import "time"

// One owner's calls run one at a time.
//
// The engine sends each step's script calls on I/O goroutines, so the replies of two
// calls in flight at once may come back in another order than Redis ran them. For
// two calls of one owner on one lock that breaks the hold count the engine mirrors:
// an Unlock racing the same handle's re-entry could leave the engine without a hold
// that Redis still has (never renewed), or tell the caller "held" for a lock already
// deleted. So an owner's direct acquires (re-entry, single try) and releases
// (Unlock, handoff) are serialized: while one is in flight, the owner's next such
// request waits here, in order, and is handled when the reply has been.
//
// Queued attempts are serialized too: a handle shared by goroutines may hold the
// lock through one goroutine while another's Lock waits in the queue, and that
// waiter's attempt is then a re-entry of the same field (startAttempt; for a fair
// lock, fairAdvance and fairReenter). A local handoff to a waiter is that waiter's
// attempt, and its owner's call as much as the releasing owner's (handoff,
// grantEarly).

// maxFreeCalls bounds machine.freeCalls, the ownerCalls kept for reuse: one per
// Unlock otherwise.
const maxFreeCalls = 256

// ownerCalls is one owner's serialization state.
type ownerCalls struct {
	busy    int       // calls its requests wait for: its own, a handoff to its waiter (early or not), the relay that granted it, and a relay's follow-up (see relay.go)
	early   bool      // a call in flight is a handoff that granted this owner early (see handoff.go)
	recheck uint64    // a hold whose force-release check is asked again once the owner is idle (see checkFound)
	pending []message // requests waiting for it, in arrival order
}

// deferCall parks msg behind the owner's call in flight; ownerBusy(k) must be
// true. Callers ask first, rather than hand every request to a function that may
// park it, which keeps the request from being boxed into a message on the common
// path, where nothing waits.
func (m *machine) deferCall(k holdKey, msg message) {
	q := m.serial[k]
	q.pending = append(q.pending, msg)
}

// markBusy records that a serialized call of the owner is now in flight.
func (m *machine) markBusy(k holdKey) {
	q := m.serial[k]
	if q == nil {
		if n := len(m.freeCalls); n > 0 {
			q = m.freeCalls[n-1]
			m.freeCalls = m.freeCalls[:n-1]
		} else {
			q = &ownerCalls{}
		}
		m.serial[k] = q
	}
	q.busy++
}

// markIdle records that the owner's call has been answered, and handles the
// requests that waited for it until one of them is in flight again.
func (m *machine) markIdle(k holdKey, now time.Time) {
	q := m.serial[k]
	if q == nil {
		return
	}
	if q.busy > 0 {
		q.busy--
	}
	if q.busy > 0 {
		return // the owner's other call is still in flight
	}
	if q.recheck != 0 {
		if h := m.holds[k]; h != nil && h.id == q.recheck {
			m.checkForced(h) // see checkFound
		}
		q.recheck = 0
	}
	q.early = false
	for len(q.pending) > 0 && q.busy == 0 {
		msg := q.pending[0]
		q.pending[0] = nil
		q.pending = q.pending[1:]
		m.handle(msg, now)
	}
	if l := m.lockByID[k.lock]; q.busy == 0 && l != nil && l.queue.head != nil {
		m.advance(l, now) // a waiter of the owner's may wait for it to be idle (fairAdvance, startAttempt)
	}
	if q.busy == 0 && len(q.pending) == 0 {
		delete(m.serial, k)
		if len(m.freeCalls) < maxFreeCalls {
			q.pending = q.pending[:0]
			m.freeCalls = append(m.freeCalls, q)
		}
	}
}

// ownerBusy reports whether the owner has a serialized call in flight.
func (m *machine) ownerBusy(k holdKey) bool {
	q := m.serial[k]
	return q != nil && q.busy > 0
}

// onSettle completes a Settle once the owner has no serialized call in flight, and
// none of its give-backs then in flight is still unanswered. First it handles the
// walked-away Acquires of the owner's whose cancellation has not come yet: their
// waiters are cancelled (cancelWalkedAway) and their unreceived grants taken back
// (takeBackWalkedAway), and what those send is waited for in the same way.
func (m *machine) onSettle(msg settleMsg) {
	if m.closing {
		msg.future.Complete(ErrClosed) // Close's releases may be in flight
		return
	}
	l := m.locks[msg.lock]
	if l == nil {
		msg.future.Complete(nil)
		return
	}
	k := holdKey{l.id, msg.owner}
	seq := m.giveBackSeq
	m.cancelWalkedAway(l, msg.owner, m.now)
	m.takeBackWalkedAway(l, msg.owner)
	if m.giveBackSeq != seq {
		msg.giveBacksBefore = 0 // a Settle handled before waits for these give-backs too
	}
	if m.ownerBusy(k) {
		msg.giveBacksBefore = 0 // its bound is set once it gets past the call (waitFrom)
		m.deferCall(k, msg)
		return
	}
	before := m.waitFrom(&msg.giveBacksBefore) // set before msg is copied into a parked entry
	if m.heldUpByGiveBacks(k, before) {
		m.deferForGiveBacks(k, msg, before)
		return
	}
	msg.future.Complete(nil)
}
