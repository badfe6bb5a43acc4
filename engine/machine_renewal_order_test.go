package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Like TestMachineDoubtRenewalOverridesLongerReentryLease, but the doubt's
// renewal R (sent before S) answers before S does. On Redis R may still have run
// after S (S ran, its reply was slow; R ran next on another connection, its reply
// fast): the key's expiry is then R's run + 30 s, about S's send + 30 s. R's
// "held" is taken (doubted, owner busy), which clears h.renewing: addHold at S's
// reply must still count on no more than the watchdog's lease from S's send.
func TestMachineDoubtRenewalAnsweredBeforeLongerReentry(t *testing.T) {
	h := newMH(t)
	start := h.now
	h.grantFresh("L", 1, 0)
	hd := h.hold("L", 1)
	lost := hd.lostSignal().C()

	h.now = start.Add(time.Second)
	h.tryLease("L", 1, time.Second)
	tc := h.take().one(t, scripts.LockAcquire)
	tSent := h.now
	h.now = h.now.Add(5 * time.Millisecond)
	h.replyAt(tc, tSent, scripts.Reply{}, errConn)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now

	h.now = h.now.Add(time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	sSent := h.now
	// Redis: S runs, then R (pexpire 30 s). R's reply comes first.
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil)
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil)
	mustGranted(t, "S", s)
	h.take()

	redisFrees := sSent.Add(30 * time.Second)
	if hd.expiresAt.After(redisFrees) {
		t.Errorf("hold expires at S's send + %v; R ran after S on Redis, which frees L at about S's send + 30 s",
			hd.expiresAt.Sub(sSent))
	}
	h.now = redisFrees
	h.fire(timerKeyExpiry(hd.id))
	h.take()
	select {
	case <-lost:
	default:
		t.Errorf("Lost still open at S's send + 30 s, when Redis may have freed L")
	}
}

// The same with a sweep renewal sent after S (the owner busy does not stop the
// sweep), answered before S: onRenewDone skips the "held" (owner busy) and clears
// h.renewing; addHold must still cap, R having been answered after S was sent.
func TestMachineSweepRenewalSentAfterLongerReentry(t *testing.T) {
	h := newMH(t)
	start := h.now
	h.grantFresh("L", 1, 0)
	hd := h.hold("L", 1)
	h.now = start.Add(7500 * time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	sSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.fire(sweepKey)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // ran after S: pexpire 30 s
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil)
	mustGranted(t, "S", s)
	h.take()
	if redisFrees := rSent.Add(30 * time.Second); hd.expiresAt.After(redisFrees) {
		t.Errorf("hold expires at S's send + %v; R (sent after S) ran after it: Redis may free L at R's send + 30 s",
			hd.expiresAt.Sub(sSent))
	}
}

// A renewal of a hold that has since been released is still a PEXPIRE of the same
// key guarded by the same field. If the owner takes the lock again with a lease
// longer than the watchdog's, that renewal may run after the new acquire on Redis
// (it was sent before, on another connection, and has not answered): Redis then
// frees the lock 30 s after the renewal ran, about the new acquire's send + 30 s.
//
//  1. Owner 1 holds L under the watchdog; at +7.5 s the sweep sends renewal R.
//  2. Its Unlock U runs on Redis and answers "released": the hold is dropped.
//  3. Its TryLock S with a 1 min lease takes L fresh (same field cid:1): new hold.
//  4. Redis runs R after S: field cid:1 exists, PEXPIRE 30 s. R answers "held".
//  5. The new hold believes S's send + 60 s; Redis frees L at about S's send + 30 s.
func TestMachineStaleRenewalOfDroppedHoldOverridesLongerFreshLease(t *testing.T) {
	staleRenewalOfDroppedHold(t, false)
}

// The same with the lock's state left unused for longer than idleKeep between the
// Unlock and the new acquire: the renewal in flight keeps it, with its count.
func TestMachineStaleRenewalOfDroppedHoldOutlivesIdleLockState(t *testing.T) {
	staleRenewalOfDroppedHold(t, true)
}

func staleRenewalOfDroppedHold(t *testing.T, idleFirst bool) {
	h, r, rSent := releasedWithRenewalOut(t)
	if idleFirst {
		h.now = h.now.Add(3 * idleKeep)
		h.fire(timer.Key{Kind: kindForget})
		h.take()
		h.fire(timer.Key{Kind: kindForget})
		h.take()
	}

	h.now = h.now.Add(time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	sSent := h.now
	h.grantThenLateRenewal(t, s, sc, sSent, r, rSent)
}

// releasedWithRenewalOut: owner 1 held L under the watchdog; at +7.5 s the sweep
// sent renewal r (at rSent), still in flight; then owner 1's Unlock released L.
func releasedWithRenewalOut(t *testing.T) (*mh, scriptCall, time.Time) {
	t.Helper()
	h, _, _ := heldUnderWatchdog(t, 1)
	r, rSent := h.sweepRenewal(t, h.now.Add(7500*time.Millisecond))
	h.now = h.now.Add(time.Millisecond)
	uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.now = h.now.Add(time.Millisecond)
	h.reply(uc, replyInt(1), nil)
	mustGet(t, "unlock", u)
	h.take()
	if h.hold("L", 1) != nil {
		t.Fatalf("setup: the hold outlived its Unlock")
	}
	return h, r, rSent
}

// grantThenLateRenewal answers S (sc, sent at sSent) "granted" and then renewal R
// (sent at rSent) "held", as when Redis ran R after S, and checks that owner 1's
// hold on L counts on no more than S's send + 30 s, R's watchdog lease.
func (h *mh) grantThenLateRenewal(t *testing.T, s *futures.Future[error], sc scriptCall, sSent time.Time, r scriptCall, rSent time.Time) {
	t.Helper()
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil)
	mustGranted(t, "S", s)
	h.take()
	hd := h.hold("L", 1)
	lost := hd.lostSignal().C()

	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // R ran after S: PEXPIRE 30 s
	h.take()

	redisFrees := sSent.Add(30 * time.Second)
	if hd.expiresAt.After(redisFrees) {
		t.Errorf("the hold expires at S's send + %v; a renewal ran after S, so Redis may free L at S's send + 30 s",
			hd.expiresAt.Sub(sSent))
	}
	if !h.expiryFires(hd, lost, redisFrees) {
		t.Errorf("Lost still open at S's send + 30 s, when Redis may have freed L")
	}
}

// Replies and sends read clocks that may not move between two events (a coarse
// monotonic clock; the engine's loop reads one time for a whole drained burst):
// a renewal answered at the same reading as the re-entry's send may still have run
// after the re-entry on Redis. Like TestMachineSweepRenewalSentAfterLongerReentry
// with the clock standing still from S's send to R's reply.
func TestMachineRenewalAnsweredAtReentrySendTime(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now
	h.now = start.Add(7500 * time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	sSent := h.now
	h.fire(sweepKey)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now
	h.replyAt(r, rSent, replyInts(1), nil) // ran after S: PEXPIRE 30 s; same clock reading as S's send
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil)
	mustGranted(t, "S", s)
	h.take()
	redisFrees := rSent.Add(30 * time.Second)
	if hd.expiresAt.After(redisFrees) {
		t.Errorf("hold expires at S's send + %v; R, answered at S's send time, may have run after S: Redis may free L at R's send + 30 s",
			hd.expiresAt.Sub(sSent))
	}
	if !h.expiryFires(hd, lost, redisFrees) {
		t.Errorf("Lost still open at R's send + 30 s, when Redis may have freed L")
	}
}

// The same through an early handoff, whose confirmation (confirmEarly) dates the
// receiver's lease from the handoff's send without looking at renewals.
//
//  1. Owner 2 holds L under the watchdog; the sweep sends renewal R of cid:2.
//  2. Owner 2's Unlock releases L; owner 1 takes it; owner 2 queues a Lock with a
//     1 min lease behind owner 1's local hold.
//  3. Owner 1's Unlock hands L over to owner 2 (early grant); the reply confirms.
//  4. Redis runs R after the handoff: cid:2 exists, PEXPIRE 30 s; R answers "held".
func TestMachineStaleRenewalOverridesEarlyHandoffLease(t *testing.T) {
	h := newMH(t)
	start := h.now
	h.grantFresh("L", 2, 0)
	r, rSent := h.sweepRenewal(t, start.Add(7500*time.Millisecond))
	h.now = h.now.Add(time.Millisecond)
	uc, u := h.unlockCall(t, "L", 2, scripts.LockRelease)
	h.reply(uc, replyInt(1), nil)
	mustGet(t, "owner 2's unlock", u)
	h.take()

	h.now = h.now.Add(time.Millisecond)
	a := h.grantFresh("L", 1, 0)
	b := h.acquire("L", 2, time.Minute, -1)
	h.take().none(t)
	h.now = h.now.Add(time.Millisecond)
	h.unlock("L", a.owner)
	c := h.take().one(t, scripts.LockHandoff)
	if !c.early {
		t.Fatal("setup: handoff not early")
	}
	cSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(c, cSent, replyInt(2), nil)
	mustGranted(t, "owner 2's Lock", b.future)
	h.take()
	hb := h.hold("L", 2)

	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // ran after the handoff: PEXPIRE 30 s
	h.take()
	if redisFrees := cSent.Add(30 * time.Second); hb.expiresAt.After(redisFrees) {
		t.Errorf("owner 2's hold expires at the handoff's send + %v; its old renewal ran after it: Redis may free L at + 30 s",
			hb.expiresAt.Sub(cSent))
	}
}
