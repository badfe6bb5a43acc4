package engine

import (
	"strconv"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
)

// The relay: local handoffs that need no script call of their own.
//
// An early handoff (handoff.go) grants its receiver at once, and the receiver's
// calls wait for the handoff's reply, so without relays a chain of holders with
// short holds makes one script call, and waits one round trip, per handoff. When
// the receiver unlocks while that call is still in flight and another local waiter
// heads the queue, the engine grants that waiter at once too, with no call: the call in
// flight puts the receiver's field on the server, and that field keeps every other
// client out for as long as the receiver's own hold would have. Holders that come
// and go while the call is in flight all run under that one field; the relay
// records them. When the reply comes:
//
//   - handed over: one follow-up handoff (lock_handoff; fair_handoff for the fair
//     lock, which also takes the holders in between out of the Redis queue, see
//     fairrun.go) moves the lock from the receiver's
//     field to the field of the holder at the relay's end (the tail), granting it
//     early as any handoff does; holders that come and go while the follow-up is
//     in flight form the next relay. The follow-up's reply answers the relayed
//     Unlocks: nil if it found the receiver's field (their holds ran under a field
//     that held the lock throughout), ErrLockLost if not (a force-release took it
//     meanwhile), or its error. If the tail's hold has ended meanwhile (its grant
//     went back, its expiry) or the client is closing, the receiver's field is
//     released owner-guarded instead, and that release's reply answers them.
//   - not handed over (the releasing owner's field was gone: a force-release; its
//     surplus; or a transport error twice): no relayed hold ever had a field on the
//     server. Their Unlocks return ErrLockLost (or the error) at once, and the
//     tail's hold is lost, as the receiver's is without a relay. A fair lock's
//     relayed holders then leave the Redis queue (fair_leave).
//
// Relayed holders whose Unlock failed have their Lost signals closed. So a chain of
// N short holds costs one call per round trip instead of one per handoff, and each
// relayed Unlock returns within two round trips. A relay grants only what a local
// handoff would: a waiter of another owner with nothing held, in flight or being
// given back, and enough lease left (canGrantEarly); for the reentrant lock below
// the chain bound, and not a waiter registered for direct grants, whose
// registration a call must drop (the chain bound counts relayed handoffs, so other
// processes' waiters wait no longer than before); for the fair lock, the waiter
// the last reply's run says heads the Redis queue now (fairrun.go).
//
// The owners whose calls wait: the receiver's until the follow-up's reply (its
// field is on the server until then, and a re-entry of it would count on the lock
// the follow-up hands over), the holders' in between until the reply that ends the
// relay (nothing of theirs is ever on the server) or, for the fair lock, until the
// follow-up's (their queue entries are, until it takes them out), and the tail's
// until the follow-up's.

// relay is the state of the local holders granted while one early handoff is in
// flight (lockState.relay).
type relay struct {
	from       holdKey                  // the call's receiver: its field is on the server after the call
	fromField  string                   // that field
	fromLease  time.Duration            // its lease (re-applied if the server still counts more)
	unlocks    []*futures.Future[error] // the relayed holders' Unlocks, answered by the call that ends the relay (answerRelay)
	lost       []*futures.Signal        // their Lost signals, if anybody asked (closed if their Unlocks fail)
	between    []uint64                 // owners granted and relayed on in between (their calls wait)
	tail       holdKey                  // the owner granted last (its calls wait)
	tailHold   uint64                   // its hold's id (0 if the grant went back at once)
	tailWaiter uint64                   // its waiter's id, for the follow-up's deregistration
}

// relayUnlock relays an Unlock of the holder granted by the early handoff in flight
// (or by the relay on it) to the next local waiter, and reports whether it did.
func (m *machine) relayUnlock(l *lockState, msg unlockMsg, now time.Time) bool {
	if !l.handingOff {
		return false
	}
	key := holdKey{l.id, msg.owner}
	h, q := m.holds[key], m.serial[key]
	if h == nil || !h.provisional || q == nil || q.busy == 0 || !q.early || len(q.pending) > 0 || m.givingBack(key) {
		return false
	}
	r := l.relay
	if r != nil && r.tail != key {
		return false // not the relay's tail: not a hold the call in flight covers
	}
	// What a handoff would grant (h the only holder, with a count of 1; no owner
	// giving back), early: for a reentrant lock below the chain bound, and not to
	// a waiter registered for direct grants, whose registration a call must drop;
	// for a fair lock, to the waiter the run says heads the queue now (fairrun.go).
	w := m.localTarget(l, h)
	if w == nil || !m.canGrantEarly(l, h, w, false, now) {
		return false
	}
	if l.fair == nil && (m.chainBound(l, now) || w.registered) {
		return false
	}
	if l.fair != nil {
		l.fairRun = l.fairRun[1:]
	}
	if r == nil {
		r = &relay{from: key, fromField: h.field, fromLease: h.lease}
		l.relay = r
	} else if key != r.from {
		r.between = append(r.between, key.owner)
	}
	l.chain++
	r.unlocks = append(r.unlocks, msg.future)
	if h.lost != nil {
		r.lost = append(r.lost, h.lost)
	}
	r.tail = holdKey{l.id, w.owner}
	r.tailWaiter = w.id
	r.tailHold = m.grantEarly(l, h, w, now)
	m.stats.Relays++
	return true
}

// endRelay settles the relay on the early handoff whose reply d is: handedOver
// reports whether the call put its receiver's field on the server.
func (m *machine) endRelay(l *lockState, r *relay, d scriptDone, handedOver bool, now time.Time) {
	err := relayOutcome(d, !handedOver)
	if d.err != nil {
		// Either field may be on the server: the receiver's goes too.
		m.abandon(l, r.from.owner, r.fromField, 0)
	}
	tail := m.holdByID[r.tailHold]
	followed := err == nil && tail != nil && !m.closing
	switch {
	case followed:
		m.followUp(l, r, tail)
	default:
		if tail != nil {
			tail.provisional = false // no call puts its field on the server
			m.loseHold(tail, false)
		}
		if err != nil {
			m.answerRelay(r, err)
		} else {
			// The receiver's field holds the lock for nobody. Its owner-guarded
			// release answers the relayed Unlocks: they ran under that field
			// if the release finds it.
			m.cleanUp(l, abandonMsg{lock: l.id, owner: r.from.owner, field: r.fromField, relayed: r})
		}
		if l.fair != nil {
			m.leaveRelayed(l, r)
		}
		m.releaseRelayed(r.tail, now)
	}
	if l.fair != nil && followed {
		return // the follow-up's reply frees the owners in between (fairrun.go)
	}
	// The owners in between wait no longer: nothing of theirs is on the server (a
	// fair lock's queue entries have been sent their leaves). The follow-up went
	// first, so the attempts this may start find the lock handed on.
	m.releaseBetween(l, r, now)
}

// followUp sends the call that moves the lock from the relay's receiver to its
// tail, an early handoff whose reply answers the relayed Unlocks.
func (m *machine) followUp(l *lockState, r *relay, tail *hold) {
	m.markBusy(r.from) // the receiver's field is on the server until the follow-up runs
	l.handingOff = true
	call := scriptCall{
		script: scripts.LockHandoff,
		keys:   l.releaseKeys,
		args: []string{r.fromField, m.leaseText(r.fromLease), tail.field, m.leaseText(tail.lease), "0", unlockMessage, "0",
			m.cfg.clientID, selfListens(l), "", strconv.FormatUint(r.tailWaiter, 10)},
		purpose:  purposeHandoff,
		lock:     l.id,
		receiver: r.tail.owner,
		hold:     tail.id,
		owner:    r.from.owner,
		serial:   true,
		early:    true,
		relayed:  r,
	}
	if l.fair != nil {
		call.script = scripts.FairHandoff
		call.keys = l.fair.keys
		call.args, call.run = m.fairHandoffArgs(r.fromField, r.fromLease, tail.field, tail.lease, true,
			m.relayedFields(r), l.queue.head, m.now)
	}
	m.run(call)
}

// relayOutcome is what the reply d of a call that answers a relay (relayed) says
// of the relayed holds: nil if the receiver's field held the lock throughout; the
// call's error (it may not have run); ErrLockLost if the call found the field gone.
func relayOutcome(d scriptDone, gone bool) error {
	switch {
	case d.err != nil:
		return d.err
	case gone:
		return errHoldLost
	}
	return nil
}

// answerRelay answers the relayed holders' Unlocks with err, and closes their
// Lost signals unless err is nil.
func (m *machine) answerRelay(r *relay, err error) {
	if err != nil {
		for _, s := range r.lost {
			s.Fire() // first: an Unlock that reports the loss finds Lost closed
		}
	}
	for _, f := range r.unlocks {
		f.Complete(err)
	}
}

// releaseRelayed ends the wait of an owner the relay kept busy: its cleanups, then
// its other requests.
func (m *machine) releaseRelayed(k holdKey, now time.Time) {
	m.sendWaitingCleanups(k.lock, k.owner)
	m.markIdle(k, now)
}
