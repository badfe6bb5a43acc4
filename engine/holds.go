package engine

import (
	"slices"
	"strconv"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// maxLostHolds bounds machine.lostHolds: handles that lost a hold and are never used
// again would otherwise keep their entry for the life of the client.
const maxLostHolds = 4096

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
	grantedAt time.Time // send time of the latest grant
	renewing  bool      // a renewal of this hold is in flight
	// provisional: granted early by a local handoff whose reply has not come back
	// (see handoff.go); the watchdog does not renew it until then.
	provisional bool
	// expiryArmed: its expiry entry is in the wheel. A watchdog hold gets one at
	// the first sweep after its grant, not at the grant (see onSweep).
	expiryArmed bool
	// maySurplus: the server may count more than the engine (see dropSurplus):
	// a reply was lost of an acquire that may have counted on it (the grant's
	// earlier attempt, a re-entry given up) or of a one-count give-back, or a
	// call took a lost hold's field again (runCleanup). Its handoffs then may
	// not hand over, so they grant nobody early, and its last count given back
	// releases the field whole (releaseOne).
	maySurplus bool
	// reentryLease: a re-entry of the owner's with a lease shorter than what is
	// left of the hold's is in flight, or ran and was given back, and this is
	// that lease (see shortenForReentry); 0 otherwise.
	reentryLease time.Duration

	lost     *futures.Signal // made when first asked for (see onLost); nil until then
	receipts []uint64        // grants still watched for an unreceived take-back
}

// lostSignal returns h's Lost signal, made on first use: most holds end without
// anyone asking for it.
func (h *hold) lostSignal() *futures.Signal {
	if h.lost == nil {
		h.lost = futures.NewSignal()
	}
	return h.lost
}

// addHold records a grant: a new hold, or one more count on the owner's hold.
// field is the owner's field.
func (m *machine) addHold(l *lockState, owner uint64, field string, lease time.Duration, sentAt, now time.Time) *hold {
	key := holdKey{l.id, owner}
	h := m.holds[key]
	if h == nil {
		delete(m.lostHolds, key)
		m.nextID++
		h = &hold{id: m.nextID, lock: l, owner: owner, field: field, lease: -1}
		m.holds[key] = h
		m.holdByID[h.id] = h
		l.holders = append(l.holders, h)
	}
	h.count++
	h.grantedAt = sentAt
	// The acquire script re-applied the expiry with this call's lease, so the hold
	// now follows it: an explicit lease, or the watchdog.
	if h.lease != 0 && lease == 0 {
		m.watchdogHolds++
	} else if h.lease == 0 && lease != 0 {
		m.watchdogHolds--
	}
	h.lease = lease
	h.expiresAt = sentAt.Add(m.leaseOf(lease))
	if lease > m.cfg.watchdog && m.renewMayFollow(l, sentAt) {
		// A renewal may have run after this call on the server and set the
		// watchdog's shorter lease back: count on no more than that.
		h.expiresAt = sentAt.Add(m.cfg.watchdog)
	}
	delete(m.leaseDoubts, h.id) // this call, sent after any failed one of the owner's, set the expiry
	h.reentryLease = 0          // and this call is the re-entry, if one was in flight
	if sentAt.Before(l.forcedAt) && !m.grantedEarly(key) {
		// A force-release that found the lock held was answered while this call was
		// in flight. (An early grant is checked once its handoff is confirmed.)
		m.checkForced(h)
	}
	if lease == 0 {
		h.nextRenew = sentAt.Add(m.cfg.watchdog / 3)
		m.armSweep()
	}
	if lease != 0 || h.expiryArmed || h.expiresAt.Sub(now) < 2*m.sweepInterval() {
		// A watchdog hold otherwise waits for the first sweep (see onSweep), unless
		// its grant came so late that the sweep could be late for it.
		m.armExpiry(h, now)
	}
	return h
}

// grantedEarly reports whether the owner's call in flight is a handoff that
// granted it early (see handoff.go).
func (m *machine) grantedEarly(k holdKey) bool {
	q := m.serial[k]
	return q != nil && q.early
}

// loseHold ends a hold that was not unlocked: its Lost signal closes. With release,
// the owner's field is deleted on the server if it is still there (owner-guarded), so
// a lock we told the holder it lost does not linger until its lease ends.
func (m *machine) loseHold(h *hold, release bool) {
	m.mayBeFree(h.lock)
	if h.lost != nil {
		h.lost.Fire()
	} // else nobody asked for it: Lost of a hold that is gone is already closed
	if len(m.lostHolds) >= maxLostHolds {
		clear(m.lostHolds) // only an error's detail is lost: Unlock says ErrNotHeld then
	}
	m.lostHolds[holdKey{h.lock.id, h.owner}] = struct{}{}
	switch {
	case h.provisional:
		// An early grant whose handoff is in flight: the handoff may yet write the
		// owner's field, so its cleanup always goes, after the reply (see abandon).
		// It drops only the grant's count: a queued Lock of the same owner may take
		// the lock again by re-entering that field once the reply is in.
		m.abandon(h.lock, h.owner, h.field, h.count)
	case release:
		m.releaseLost(h)
	}
	m.dropHold(h)
}

// releaseLost sends the owner-guarded release of lost hold h's field. While a call
// of the owner's is in flight (a re-entry, or a TryLock of a handle shared by
// goroutines), it waits for that call's reply: sent now, it could run after the
// call and delete the hold the call takes. If the call took the field, the release
// does not go, and the new hold may count the lost one's counts too (maySurplus).
// (An early handoff's receiver's cleanups wait for its reply in cleanUp.)
func (m *machine) releaseLost(h *hold) {
	c := abandonMsg{lock: h.lock.id, owner: h.owner, field: h.field, afterLoss: true}
	if k := (holdKey{h.lock.id, h.owner}); m.ownerBusy(k) && !m.serial[k].early {
		m.parkCleanup(h.lock, c)
		return
	}
	m.cleanUp(h.lock, c)
}

// parkCleanup parks owner-guarded release c behind its owner's call in flight, to
// run when the owner is idle (markIdle) or, behind an early handoff, at its reply
// (sendWaitingCleanups); either way through runCleanup. The lock's state stays
// live until then (cleanupsWaiting): Close, for one, forgets a lock's state as soon
// as nothing else refers to it.
//
// It goes ahead of the owner's requests that wait for the same call (after the
// cleanups parked before it): the hold no longer counts what c releases, while
// Redis does until c runs, so a waiting Unlock sent first would release on a count
// one too low (its bound, and its handoff decision: a receiver granted early would
// lose the lock at once). Sent first, c is a give-back those requests then wait for
// (giveback.go).
func (m *machine) parkCleanup(l *lockState, c abandonMsg) {
	q := m.serial[holdKey{l.id, c.owner}]
	at := slices.IndexFunc(q.pending, func(msg message) bool {
		_, cleanup := msg.(abandonMsg)
		return !cleanup
	})
	if at < 0 {
		at = len(q.pending)
	}
	q.pending = slices.Insert(q.pending, at, message(c))
	l.cleanupsWaiting++
}

// pruneReceipts stops watching grants of h that have been received (a received
// grant is never taken back), so a long-held, often re-entered lock does not
// accumulate context registrations. A grant whose completion deliver deferred
// to the end of the step is not completed yet, and its empty channel does not
// mean it was received. (Complete sets the flag before it sends: completed and
// empty means received only because every grant's Complete, this check and
// Revoke run on the machine's side, one at a time.)
func (m *machine) pruneReceipts(h *hold) {
	kept := h.receipts[:0]
	for _, id := range h.receipts {
		r := m.receipts[id]
		if r == nil {
			continue
		}
		if r.future.IsCompleted() && len(r.future.C()) == 0 { // received
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
	delete(m.leaseDoubts, h.id)
	for i, x := range l.holders {
		if x == h {
			l.holders = slices.Delete(l.holders, i, i+1) // zeroes the freed slot
			break
		}
	}
	if h.lease == 0 {
		m.watchdogHolds--
	}
	if h.expiryArmed {
		m.cancelTimer(timer.Key{Kind: kindExpiry, ID: h.id})
	}
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
// run, and its retry then counted twice. Nobody owns the surplus, so it goes. (No
// attempt of the same owner can be the extra count: the owner's attempts and
// releases are serialized, see serial.go, and its give-backs go first, see
// giveback.go.)
func (m *machine) dropSurplus(h *hold) {
	l := h.lock
	m.dropHold(h)
	m.abandon(l, h.owner, h.field, 0)
}

// releaseOne gives back one count of h: a grant nobody received. The counts h
// keeps bound the release, which a lost reply may have the engine send twice
// (keepHeld). With afterCalls, while a call of the owner's is in flight (an
// Unlock, whose own bound counted this count), the give-back waits for its reply
// (ahead of the owner's other waiting requests: see parkCleanup): running first,
// it would leave that Unlock's bound too high, and the Unlock would take nothing.
// (Without it, the caller is handling the owner's call's reply itself.)
func (m *machine) releaseOne(h *hold, afterCalls bool) {
	h.count--
	c := abandonMsg{lock: h.lock.id, owner: h.owner, field: h.field, drop: 1, keepHeld: true}
	if h.count <= 0 && h.maySurplus {
		// Its last count: a surplus count the server may hold goes too (see
		// dropSurplus), or it would keep the lock for nobody until its lease ends.
		c.drop, c.keepHeld = 0, false
	}
	if k := (holdKey{h.lock.id, h.owner}); afterCalls && m.ownerBusy(k) {
		m.parkCleanup(h.lock, c)
	} else {
		m.cleanUp(h.lock, c)
	}
	if h.count <= 0 {
		m.dropHold(h)
	}
}

// abandon runs the owner-guarded release of drop holds (0: all) of owner, whose
// field is field (its handle's, or a direct grant's: see directgrant.go).
//
// On a fair lock the owner counts as leaving until it has run: a join of the same
// owner meanwhile could otherwise take the hold for a direct grant it had not heard
// of (fair_acquire's claim) just before this release deletes it.
//
// While a handoff that granted the owner early is in flight, the release waits for
// its reply: sent at once, it could reach Redis first and find nothing to release.
func (m *machine) abandon(l *lockState, owner uint64, field string, drop int) {
	m.cleanUp(l, abandonMsg{lock: l.id, owner: owner, field: field, drop: drop})
}

// cleanUp runs the owner-guarded release c describes (see abandon).
func (m *machine) cleanUp(l *lockState, c abandonMsg) {
	if q := m.serial[holdKey{l.id, c.owner}]; q != nil && q.busy > 0 && q.early {
		m.parkCleanup(l, c)
		return
	}
	keys := []string{l.name, l.channel}
	if l.fair != nil {
		keys = append(keys, l.fair.queue)
		m.addLeaving(l, c.owner)
	}
	k := holdKey{l.id, c.owner}
	args := []string{unlockMessage, c.field, strconv.Itoa(c.drop)}
	if h := m.holds[k]; c.keepHeld && h != nil && h.field == c.field && h.count > 0 {
		args = append(args, strconv.Itoa(h.count)) // the counts the owner keeps, as of now
	}
	call := scriptCall{
		script:   scripts.LockReleaseOwner,
		keys:     keys,
		args:     args,
		purpose:  purposeAbandon,
		lock:     l.id,
		owner:    c.owner,
		giveBack: m.startGiveBack(k),
		relayed:  c.relayed,
	}
	if len(args) == 4 {
		// Bounded by the counts the owner keeps as of now: such give-backs of one
		// owner run one at a time, in order. Two in flight at once could run in
		// the other order (or the first's retry after the second), and the first
		// would then find its bound reached by the second's drop and take nothing:
		// Redis would count one more than the engine.
		if q, inFlight := m.boundedGiveBacks[k]; inFlight {
			m.boundedGiveBacks[k] = append(q, call)
			l.cleanupsWaiting++ // sent by nextBoundedGiveBack
			return
		}
		m.boundedGiveBacks[k] = nil
	}
	m.run(call)
}

// nextBoundedGiveBack sends the owner's next bounded give-back that waited for the
// one whose final reply d is (see cleanUp).
func (m *machine) nextBoundedGiveBack(d scriptDone) {
	if d.call.script != scripts.LockReleaseOwner || len(d.call.args) != 4 {
		return
	}
	k := holdKey{d.call.lock, d.call.owner}
	q, ok := m.boundedGiveBacks[k]
	if !ok {
		return
	}
	if len(q) == 0 {
		delete(m.boundedGiveBacks, k)
		return
	}
	next := q[0]
	q[0] = scriptCall{}
	m.boundedGiveBacks[k] = q[1:]
	if l := m.lockByID[k.lock]; l != nil {
		l.cleanupsWaiting--
	}
	m.run(next)
}
