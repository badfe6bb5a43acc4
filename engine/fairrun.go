package engine

import (
	"slices"
	"strconv"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// The fair lock's run: what the engine knows of the Redis queue's front, and the
// fair relay it allows.
//
// A fair handoff may only go to the Redis queue's head. Every fair_handoff call
// names the local waiters that stand, in local order, after its receiver in the
// Redis queue as far as this client can tell (the run: up to maxFairRun of them,
// local order being Redis queue order for the local waiters in it, see fair.go),
// and its reply, 2 + n, says that the first n of them now head the queue in that
// order. Nothing joins a queue anywhere but at its tail, so that stays true until
// they leave it: until their turn, a leave of their own, or a purge of a waiter
// gone quiet for a whole wait allowance. lockState.fairRun keeps it.
//
// That knowledge lets the fair lock relay (relay.go) as the reentrant lock does:
// when the receiver of an early handoff unlocks while that handoff is in flight
// and the local queue's head is fairRun[0], the head is granted at once, with no
// call, under the receiver's field, which the call in flight puts on the server;
// and so on down the run. The follow-up that ends the relay is a fair_handoff
// from the receiver's field to the tail's that names the relayed holders in
// between (ARGV[11..]): they have had their turn, and leave the queue in the same
// call, whatever its outcome. Where a reentrant lock bounds its relays (the chain
// bound), the fair lock needs none: each relayed holder heads the queue when its
// turn comes, as it would if its own handoff had been sent.
//
// The owners in between stay busy until the follow-up's reply (the reentrant
// lock's are freed at the reply before): their next Lock joins the queue under
// the same field, so it must reach Redis after the follow-up has taken their old
// entry out. When no follow-up runs (the handoff failed, the tail's hold ended,
// the client is closing), or it handed nothing over (its reply nil or 0, or a
// transport error twice), their entries and the tail's leave the queue with
// fair_leave, as a receiver's does after a failed handoff.

// maxFairRun bounds a fair handoff's run: the queue's front one call can confirm,
// and so the relays one round trip can make.
const maxFairRun = 32

// fairHandoffArgs builds fair_handoff's ARGV for a handoff from fromField to
// toField (early: granted already), with the relayed fields that leave the queue
// first, and the run: the enqueued local waiters from start on, in order, up to
// the first that is not (the rest have not joined yet, or wait behind one that
// has not). It returns the args and the run's waiter ids.
func (m *machine) fairHandoffArgs(fromField string, fromLease time.Duration, toField string, toLease time.Duration,
	early bool, relayed []string, start *waiter, now time.Time) ([]string, []uint64) {
	var run []uint64
	var fields []string
	for v := start; v != nil && v.enqueued && len(run) < maxFairRun; v = v.next {
		run = append(run, v.id)
		fields = append(fields, m.waiterField(v))
	}
	earlyFlag, first := "0", ""
	if early {
		earlyFlag = "1"
	}
	if len(fields) > 0 {
		first = fields[0]
		fields = fields[1:]
	}
	args := make([]string, 0, 11+len(relayed)+len(fields))
	args = append(args, fromField, m.leaseText(fromLease), toField, m.leaseText(toLease),
		m.fairWaitText, wallMillis(now), unlockMessage, earlyFlag, first, "0", strconv.Itoa(len(relayed)))
	args = append(args, relayed...)
	return append(args, fields...), run
}

// handedOver reports whether handoff reply d says the lock passed to the call's
// receiver: lock_handoff's 2 or 5 (and somebody else listened: noteListeners),
// fair_handoff's 2 + n.
func handedOver(d scriptDone) bool {
	switch {
	case d.err != nil || d.reply.Nil:
		return false
	case d.call.script == scripts.FairHandoff:
		return d.reply.Int >= 2
	}
	return d.reply.Int == 2 || d.reply.Int == 5
}

// noteFairRun records what a fair handoff's reply d, which handed over, says of
// the Redis queue's front: its run's first n waiters head it now. Those that r,
// the relay on that call, granted meanwhile have had their turn: the run starts
// after its tail (and is unknown if the reply does not reach that far).
func (m *machine) noteFairRun(l *lockState, d scriptDone, r *relay) {
	if l == nil || l.fair == nil {
		return
	}
	n := min(max(int(d.reply.Int)-2, 0), len(d.call.run))
	known := d.call.run[:n]
	if r != nil {
		i := slices.Index(known, r.tailWaiter)
		if i < 0 {
			l.fairRun = nil
			return
		}
		known = known[i+1:]
	}
	l.fairRun = known
}

// relayedFields are the fields of r's holders in between, for the follow-up.
func (m *machine) relayedFields(r *relay) []string {
	fields := make([]string, len(r.between))
	for i, owner := range r.between {
		fields[i] = ownerField(m.cfg.clientID, owner)
	}
	return fields
}

// fairFollowUpLeaves makes a fair relay's holders in between leave the Redis
// queue when its follow-up d did not hand over: after two transport errors it may
// not have run; and a release that found the lock free (a force-release took it
// from the relay's receiver) may have granted one of them directly, at the head,
// before the follow-up took their entries out. The leave gives such a grant back.
func (m *machine) fairFollowUpLeaves(l *lockState, d scriptDone) {
	if !handedOver(d) {
		m.leaveOwners(l, d.call.relayed.between)
	}
}

// releaseBetween ends the wait of a relay's holders in between: at the reply
// that ends the relay, or for a fair lock once its follow-up is answered (and
// their leaves, if any, sent).
func (m *machine) releaseBetween(l *lockState, r *relay, now time.Time) {
	for _, owner := range r.between {
		m.releaseRelayed(holdKey{l.id, owner}, now)
	}
}

// leaveRelayed takes the entries of a fair relay's holders, in between and at
// its tail, out of the Redis queue when no follow-up will.
func (m *machine) leaveRelayed(l *lockState, r *relay) {
	m.leaveOwners(l, append(slices.Clip(r.between), r.tail.owner))
}

// leaveOwners takes the owners' entries out of l's Redis queue (fair_leave).
func (m *machine) leaveOwners(l *lockState, owners []uint64) {
	for _, owner := range owners {
		m.fairLeaveOwner(l, owner, ownerField(m.cfg.clientID, owner))
	}
}
