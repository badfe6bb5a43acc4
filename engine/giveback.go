package engine

import (
	"slices"
	"time"
)

// Give-backs.
//
// A give-back is an owner-guarded release of a grant the owner never received: an
// abandon (a grant that came after its Lock's context ended, or the clean-up of a
// lost hold), or a fair leave that may find a direct grant it did not hear of. It
// is not one of the owner's serialized calls: it is sent when the engine learns
// the grant has nobody to receive it, whatever else the owner does.
//
// Until its reply Redis still counts that grant, and a call of the same owner's
// sent meanwhile may run first: an Unlock would then find one count more than the
// engine knows of (a handoff would not hand over, yet the receiver was granted
// early), and a new grant to the owner would be undone by the give-back's release.
// So, while an owner has give-backs in flight:
//   - its Unlock, direct acquire (re-entry, single try) and Settle wait for the
//     give-backs in flight when they got past the owner's serialized call, if any.
//     An Unlock or direct acquire that waited for them then also waits for those
//     started meanwhile (rebound): not sent yet, it would otherwise reach Redis
//     ahead of a give-back whose count the hold no longer has. While the owner
//     holds, its new grants wait for its give-backs, so no endless stream of them
//     can build up. A Settle sends nothing and keeps its first bound (a stream of
//     give-backs must not starve HoldCount). An Unlock with no hold to release
//     answers at once, and a waiting direct acquire is answered when its context
//     ends (cancelParked);
//   - its queued attempt waits (startAttempt), and no local handoff goes to it
//     (handoffTarget); a fair lock's owner counts as leaving instead (see
//     addLeaving), which keeps its attempts and grants back in the same way.

// parkedMsg is a request waiting for the owner's give-backs numbered below before.
type parkedMsg struct {
	msg    message
	before uint64
}

// startGiveBack records a give-back of the owner's and returns its sequence number.
func (m *machine) startGiveBack(k holdKey) uint64 {
	m.giveBackSeq++
	m.giveBacks[k] = append(m.giveBacks[k], m.giveBackSeq)
	return m.giveBackSeq
}

// givingBack reports whether the owner has a give-back in flight.
func (m *machine) givingBack(k holdKey) bool { return len(m.giveBacks[k]) > 0 }

// waitFrom returns the bound a request's give-back wait uses (see
// deferForGiveBacks): *before as set at its first handling, or, when unset, one
// past the last give-back now, which it is then set to.
func (m *machine) waitFrom(before *uint64) uint64 {
	if *before == 0 {
		*before = m.giveBackSeq + 1
	}
	return *before
}

// heldUpByGiveBacks reports whether one of the owner's give-backs numbered below
// before is in flight: a request with that bound then waits (deferForGiveBacks). A
// request's bound is set once it gets past the owner's serialized call (waitFrom),
// so that it waits for every give-back sent before then (and, but for a Settle,
// for those sent while it waited: rebound). A request that waited for give-backs and then finds the owner's call in flight
// waits for that call with its bound unset: a give-back parked behind the call
// (parkCleanup) goes out ahead of it when the call is answered, and the request,
// getting past the call after it, waits for that give-back too.
func (m *machine) heldUpByGiveBacks(k holdKey, before uint64) bool {
	inFlight := m.giveBacks[k]
	return len(inFlight) > 0 && inFlight[0] < before
}

// deferForGiveBacks parks msg until none of the owner's give-backs numbered below
// before is in flight; heldUpByGiveBacks(k, before) must be true.
func (m *machine) deferForGiveBacks(k holdKey, msg message, before uint64) {
	m.afterGiveBacks[k] = append(m.afterGiveBacks[k], parkedMsg{msg: msg, before: before})
}

// giveBackDone records the final reply of the owner's give-back seq, hands the
// requests that no earlier give-back holds up any more back to handle, and lets a
// queued attempt of the owner's go once none is left.
func (m *machine) giveBackDone(k holdKey, seq uint64, now time.Time) {
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
	if parked := m.afterGiveBacks[k]; len(parked) > 0 {
		oldest := uint64(0) // the oldest give-back still in flight; 0: none
		if len(inFlight) > 0 {
			oldest = inFlight[0]
		}
		var due []message
		kept := parked[:0]
		for _, p := range parked {
			if oldest != 0 && oldest < p.before {
				kept = append(kept, p)
			} else {
				due = append(due, p.msg)
			}
		}
		clear(parked[len(kept):])
		if len(kept) == 0 {
			delete(m.afterGiveBacks, k)
		} else {
			m.afterGiveBacks[k] = kept
		}
		for _, msg := range due {
			m.handle(rebound(msg), now) // in arrival order; each checks the owner's state again
		}
	}
	if l := m.lockByID[k.lock]; len(inFlight) == 0 && l != nil && l.fair == nil && l.queue.head != nil {
		m.advance(l, now) // a queued attempt of the owner's may have waited (startAttempt)
	}
}

// answerParkedOnClose hands every request still waiting for give-backs to handle,
// which answers it ErrClosed (Close's releases are on their way).
func (m *machine) answerParkedOnClose() {
	for k, parked := range m.afterGiveBacks {
		delete(m.afterGiveBacks, k)
		for _, p := range parked {
			m.handle(p.msg, m.now)
		}
	}
}

// parkAcquire parks a direct acquire (re-entry, single try) behind the owner's
// serialized call or give-backs in flight, as for any request of the owner's, and
// remembers where, so that its cancellation can answer it (cancelParked).
func (m *machine) parkAcquire(k holdKey, msg acquireMsg) bool {
	if m.ownerBusy(k) {
		msg.giveBacksBefore = 0 // its bound is set once it gets past the call (waitFrom)
		m.deferCall(k, msg)
		m.parkedAcquires[msg.id] = k
		return true
	}
	before := m.waitFrom(&msg.giveBacksBefore) // set before msg is copied into a parked entry
	if m.heldUpByGiveBacks(k, before) {
		m.deferForGiveBacks(k, msg, before)
		m.parkedAcquires[msg.id] = k
		return true
	}
	return false
}

// cancelParked answers a parked acquire whose context ended with that error, and
// reports whether msg was for one: it is not a waiter yet, and its caller waits
// for the answer.
func (m *machine) cancelParked(msg cancelMsg) bool {
	k, ok := m.parkedAcquires[msg.id]
	if !ok {
		return false
	}
	delete(m.parkedAcquires, msg.id)
	isIt := func(x message) bool {
		a, ok := x.(acquireMsg)
		return ok && a.id == msg.id
	}
	var found message
	if q := m.serial[k]; q != nil {
		if i := slices.IndexFunc(q.pending, isIt); i >= 0 {
			found = q.pending[i]
			q.pending = slices.Delete(q.pending, i, i+1)
		}
	}
	if parked := m.afterGiveBacks[k]; found == nil {
		if i := slices.IndexFunc(parked, func(p parkedMsg) bool { return isIt(p.msg) }); i >= 0 {
			found = parked[i].msg
			m.afterGiveBacks[k] = slices.Delete(parked, i, i+1)
			if len(m.afterGiveBacks[k]) == 0 {
				delete(m.afterGiveBacks, k)
			}
		}
	}
	if a, ok := found.(acquireMsg); ok {
		m.complete(a.future, a.stop, msg.err)
	}
	return true
}

// rebound clears the give-back bound of an Unlock or direct acquire that waited
// for give-backs, as it is handled again: it has not been sent, so it waits for
// every give-back of the owner's in flight now, those started while it waited
// included (a walked-away grant taken back, a lost hold's release, a fair leave;
// or one that a request handled just before it in the same giveBackDone started).
// Sent before such a give-back has run, an Unlock would release on a count one too
// low (its bound and its handoff decision read the hold, which no longer counts
// the give-back's count while Redis does), and an acquire could take what the
// give-back then deletes (a whole-field release, a fair leave's claim). A Settle
// sends nothing and keeps its bound (TestMachineSettleNotStarvedByLaterGiveBacks).
func rebound(msg message) message {
	switch v := msg.(type) {
	case unlockMsg:
		v.giveBacksBefore = 0
		return v
	case acquireMsg:
		v.giveBacksBefore = 0
		return v
	}
	return msg
}
