package engine

import (
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// The watchdog: batched renewals of the holds without an explicit lease, and the
// lease deadline of every hold, after which its Lost signal closes.

// expiryMargin is how long before expiresAt a hold is declared lost, so Lost closes
// before the lease could have run out on the server even if the wheel fires late
// and the loop is slow to get to it: 5% of the lease, at least 10 ms, at most
// 500 ms and at most half the lease. (At 2 ms, a loaded 2-core machine closed Lost
// after the server's expiry in a few of a hundred short leases.)
func expiryMargin(lease time.Duration) time.Duration {
	return min(max(lease/20, 10*time.Millisecond), 500*time.Millisecond, lease/2)
}

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
		if h.lease == 0 && !h.expiryArmed {
			// Its expiry entry, armed now rather than at the grant: most holds end
			// within a sweep interval, and a wheel entry armed and cancelled per
			// hold cost more than the rest of the hold's bookkeeping. The lease
			// (the watchdog) is 12 sweep intervals, so the entry is still in time.
			m.armExpiry(h, now)
		}
		if h.lease != 0 || h.renewing || h.provisional || h.nextRenew.After(horizon) {
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

func (m *machine) renew(batch []*hold) { m.renewWith(batch, m.watchdogText, false) }

// renewWith sends a renewal of batch with the lease text lease; check marks the
// call as checkForced's.
func (m *machine) renewWith(batch []*hold, lease string, check bool) {
	keys := make([]string, len(batch))
	args := make([]string, 1, len(batch)+1)
	ids := make([]uint64, len(batch))
	args[0] = lease
	for i, h := range batch {
		h.renewing = true
		h.lock.renewsOut++
		keys[i] = h.lock.name
		args = append(args, h.field)
		ids[i] = h.id
	}
	m.stats.Renewals += uint64(len(batch))
	m.run(scriptCall{script: scripts.LockRenew, keys: keys, args: args, purpose: purposeRenew, batch: ids, check: check})
}

// checkForced asks the server whether h's field is still there, h having been
// granted by a call whose order against a force-release that found the lock held
// is unknown: calls on different connections need not run in the order they were
// sent, so the grant may have run first, and been deleted by it. The check is a
// renewal of h alone, sent after both replies, so it runs after both; a "not
// held" ends h (checkFound). Until its reply, h is believed: one round trip.
//
// The lease is never below the watchdog's: the check is a PEXPIRE guarded by h's
// field, and may run after a later acquire of that field (a re-entry, the owner's
// next Lock), so a shorter lease than that acquire's would cut the key's expiry
// below what the engine believes. With at least the watchdog's, it only extends
// the expiry: leases longer than the watchdog's count on the watchdog's while a
// renewal may follow (renewMayFollow). A short explicit lease is thus stretched
// on the server; the engine still ends the hold, and releases its field, at its
// own deadline (onExpiry).
func (m *machine) checkForced(h *hold) {
	lease := h.lease
	if lease < m.cfg.watchdog {
		lease = 0 // the watchdog's
	}
	m.renewWith([]*hold{h}, m.leaseText(lease), true)
}

// checkFound reports whether checkForced's reply d (h the i-th of its batch) lets
// h stand. A call of the owner's in flight (an Unlock, a re-entry) decides
// instead, as for any renewal: its reply sees the field gone if the force-release
// deleted it. A failed check ends h, its field released owner-guarded: early is
// safe. A "held" reply goes on as a renewal's would (onRenewDone): for a watchdog
// hold it is one (its lease is the watchdog's), and a hold whose lease came in
// doubt meanwhile gets the renewal it waited for.
//
// A "not held" set aside for a call of the owner's is asked again once the owner
// is idle (ownerCalls.recheck, see markIdle): the call may have run before the
// force-release and keep the hold by its reply (an Unlock that left a count, a
// re-entry).
func (m *machine) checkFound(h *hold, d scriptDone, i int, now time.Time) bool {
	if d.err == nil && i < len(d.reply.Ints) && d.reply.Ints[i] == 1 {
		return true
	}
	if k := (holdKey{h.lock.id, h.owner}); m.ownerBusy(k) {
		m.serial[k].recheck = h.id
		return true
	}
	l := h.lock
	m.loseHold(h, d.err != nil)
	m.advance(l, now)
	m.maybeForget(l)
	return false
}

func (m *machine) onRenewDone(d scriptDone, now time.Time) {
	for _, name := range d.call.keys {
		if l := m.locks[name]; l != nil && l.renewsOut > 0 { // kept while renewsOut > 0
			l.renewsOut--
			l.renewAnswered = now
			defer m.maybeForget(l) // after the holds' outcomes below
		}
	}
	for i, id := range d.call.batch {
		h := m.holdByID[id]
		if h == nil {
			continue
		}
		h.renewing = false
		if d.call.check && !m.checkFound(h, d, i, now) {
			continue
		}
		if h.lease != 0 {
			continue
		}
		if d.err != nil {
			// The next sweep retries; the expiry entry guards the deadline. A hold
			// whose lease is in doubt cannot wait for its renewal time: one sent
			// before the doubt began is replaced at once, and after a failed one
			// sent since, the next sweep renews it (not at once: with the server
			// down, that would go round as fast as calls fail).
			if doubt, ok := m.leaseDoubts[id]; ok {
				if d.sentAt.Before(doubt.since) {
					m.renewDoubted(h)
				} else if h.nextRenew.After(now) {
					h.nextRenew = now
				}
			}
			continue
		}
		if doubt, ok := m.leaseDoubts[id]; ok && d.sentAt.Before(doubt.since) {
			// Sent before a call that may have shortened the lock's expiry was heard
			// to fail: it may have run before that call. Another goes.
			m.renewDoubted(h)
			continue
		}
		_, doubted := m.leaseDoubts[id]
		if m.ownerBusy(holdKey{h.lock.id, h.owner}) && !(doubted && i < len(d.reply.Ints) && d.reply.Ints[i] == 1) {
			// An Unlock or re-entry in flight decides; the next sweep renews. A
			// hold whose lease is in doubt takes a "held": the server then has the
			// field with the watchdog's lease from the renewal on, or has deleted it
			// since, and only the call in flight can change that, which its own
			// reply handles; it could not wait for the next sweep.
			continue
		}
		if i < len(d.reply.Ints) && d.reply.Ints[i] == 1 {
			delete(m.leaseDoubts, id)
			h.reentryLease = 0
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

// renewMayFollow reports whether a renewal of one of l's holds may have run on
// the server after a call sent at sentAt, and so set the watchdog's lease on the
// key after that call set its own: a renewal in flight, or one answered at or after
// sentAt (replies need not come back in the order the server ran the calls, and
// two clock readings may be equal). One answered before sentAt ran before the
// call. It counts renewals of holds dropped since (an Unlock, a loss): each is a
// PEXPIRE guarded by its owner's field, which that owner's next acquire writes
// again. It does not tell owners apart, which at worst ends a hold early.
func (m *machine) renewMayFollow(l *lockState, sentAt time.Time) bool {
	return l.renewsOut > 0 || !l.renewAnswered.Before(sentAt)
}

// marginOf is h's expiry margin: its lease's, or, while its lease is in doubt
// (leaseDoubts) or a shorter re-entry is in flight (reentryLease), the shorter
// lease's that may have set its expiry.
func (m *machine) marginOf(h *hold) time.Duration {
	lease := m.leaseOf(h.lease)
	if h.reentryLease > 0 {
		lease = min(lease, h.reentryLease)
	}
	if len(m.leaseDoubts) > 0 {
		if d, ok := m.leaseDoubts[h.id]; ok {
			lease = min(lease, d.lease)
		}
	}
	return expiryMargin(lease)
}

func (m *machine) armExpiry(h *hold, now time.Time) {
	h.expiryArmed = true
	d := h.expiresAt.Add(-m.marginOf(h)).Sub(now)
	m.schedule(timer.Key{Kind: kindExpiry, ID: h.id}, d)
}

func (m *machine) onExpiry(id uint64, now time.Time) {
	h := m.holdByID[id]
	if h == nil {
		return
	}
	deadline := h.expiresAt.Add(-m.marginOf(h))
	if left := deadline.Sub(now); left > timer.Tick {
		m.schedule(timer.Key{Kind: kindExpiry, ID: id}, left) // early, or renewed since
		return
	}
	l := h.lock
	m.loseHold(h, true)
	m.advance(l, now)
	m.maybeForget(l)
}
