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
// Queued attempts need no such care: an owner in the queue holds nothing, and its
// queued attempt is its only call. (A fair lock's queued waiter whose handle came
// to hold the lock meanwhile re-enters as a serialized call: see fairReenter; and
// no fair waiter joins while its owner has a serialized call in flight.)

// maxFreeCalls bounds machine.freeCalls, the ownerCalls kept for reuse: one per
// Unlock otherwise.
const maxFreeCalls = 256

// ownerCalls is one owner's serialization state.
type ownerCalls struct {
	active  bool      // a serialized call is in flight
	early   bool      // that call is a handoff that granted this owner early (see handoff.go)
	pending []message // requests waiting for it, in arrival order
}

// deferIfBusy parks msg behind the owner's call in flight and reports whether it did.
func (m *machine) deferIfBusy(k holdKey, msg message) bool {
	q := m.serial[k]
	if q == nil || !q.active {
		return false
	}
	q.pending = append(q.pending, msg)
	return true
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
	q.active = true
}

// markIdle records that the owner's call has been answered, and handles the
// requests that waited for it until one of them is in flight again.
func (m *machine) markIdle(k holdKey, now time.Time) {
	q := m.serial[k]
	if q == nil {
		return
	}
	q.active = false
	q.early = false
	for len(q.pending) > 0 && !q.active {
		msg := q.pending[0]
		q.pending[0] = nil
		q.pending = q.pending[1:]
		m.handle(msg, now)
	}
	if l := m.lockByID[k.lock]; !q.active && l != nil && l.fair != nil && l.queue.head != nil {
		m.advance(l, now) // a fair waiter of the owner's may wait for it to be idle (fairAdvance)
	}
	if !q.active && len(q.pending) == 0 {
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
	return q != nil && q.active
}

// A give-back is an owner-guarded release of a grant the owner never received: an
// abandon (a grant that came after its Lock's context ended, or the clean-up of a
// lost hold), or a fair leave that may find a direct grant it did not hear of.
// Until its reply, Redis still counts that grant, which HoldCount would report, so
// Settle waits for the give-backs in flight when it arrives (not for later ones,
// which would let a stream of them starve it).

// parkedSettle is a Settle waiting for the owner's give-backs up to upTo.
type parkedSettle struct {
	msg  settleMsg
	upTo uint64
}

// startGiveBack records a give-back of the owner's and returns its sequence number.
func (m *machine) startGiveBack(k holdKey) uint64 {
	m.giveBackSeq++
	m.giveBacks[k] = append(m.giveBacks[k], m.giveBackSeq)
	return m.giveBackSeq
}

// onSettle completes a Settle once the owner has no serialized call in flight, and
// none of its give-backs then in flight is still unanswered.
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
	if m.deferIfBusy(k, msg) {
		return
	}
	if len(m.giveBacks[k]) > 0 {
		m.settling[k] = append(m.settling[k], parkedSettle{msg: msg, upTo: m.giveBackSeq})
		return
	}
	msg.future.Complete(nil)
}

// giveBackDone records the final reply of the owner's give-back seq, and completes
// the Settles that no earlier give-back holds up any more (or, if the owner has a
// serialized call in flight by now, parks them behind it).
func (m *machine) giveBackDone(k holdKey, seq uint64) {
	inFlight := m.giveBacks[k]
	for i, s := range inFlight {
		if s == seq {
			inFlight = append(inFlight[:i], inFlight[i+1:]...)
			break
		}
	}
	if len(inFlight) == 0 {
		delete(m.giveBacks, k)
	} else {
		m.giveBacks[k] = inFlight
	}
	parked := m.settling[k]
	if len(parked) == 0 {
		return
	}
	oldest := uint64(0) // the oldest give-back still in flight; 0: none
	if len(inFlight) > 0 {
		oldest = inFlight[0]
	}
	kept := parked[:0]
	for _, p := range parked {
		if oldest != 0 && oldest <= p.upTo {
			kept = append(kept, p)
			continue
		}
		// A serialized call the owner started meanwhile (an early grant to it,
		// say) is waited for as well.
		if !m.deferIfBusy(k, p.msg) {
			p.msg.future.Complete(nil)
		}
	}
	clear(parked[len(kept):])
	if len(kept) == 0 {
		delete(m.settling, k)
	} else {
		m.settling[k] = kept
	}
}
