package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
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
