package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// Holds whose lease a lost re-entry may have shortened (leaseDoubts): renewals
// sent before the doubt began, renewals that fail, and renewals answered while
// the owner has a call in flight.

// renewalsIn returns the LockRenew calls of s that name hold id.
func renewalsIn(s step, id uint64) []scriptCall {
	var out []scriptCall
	for _, c := range s.calls(scripts.LockRenew) {
		for _, b := range c.batch {
			if b == id {
				out = append(out, c)
				break
			}
		}
	}
	return out
}

// Two failed re-entries in a row. The second one's lease does not end sooner
// than the expiry the first brought forward, so reentryMayHaveRun returns early
// and leaves the doubt's since at the first failure. The renewal sent at the
// first failure (after since, so trusted) was sent before the second re-entry,
// and Redis may have run it first: its reply then says nothing of the expiry the
// second re-entry set.
//
//  1. Owner 1 holds L under the watchdog.
//  2. +1 s: TryLock T1 (lease 1 s); its reply is lost at +1.005 s: expiry
//     brought forward to +2 s, doubt since +1.005 s; renewal R goes at once.
//  3. +1.006 s: TryLock T2 (lease 1 s) of the same handle; its reply is lost at
//     +1.011 s. at = +2.006 s is not before +2 s: nothing recorded.
//  4. Redis ran R, then T2: the lock expires at about +2.006 s.
//  5. R's reply (1), owner idle: R's send (+1.005 s) is not before since: the
//     doubt clears and the hold expires at +31.005 s; next renewal at +11 s.
//     Another process takes L at +2.01 s while Lost stays open.
func TestMachineSecondLostReentryNotUndoneByRenewalSentBetween(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now

	h.now = start.Add(time.Second)
	h.lostTry(t, time.Second)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now

	h.now = h.now.Add(time.Millisecond)
	t2Sent := h.lostTry(t, time.Second) // ran after R; its reply is lost
	renewedAfterT2 := len(renewalsIn(h.take(), hd.id)) > 0

	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // R ran before T2
	renewedAfterT2 = renewedAfterT2 || len(renewalsIn(h.take(), hd.id)) > 0
	if renewedAfterT2 {
		return
	}
	redisFrees := t2Sent.Add(time.Second)
	if hd.expiresAt.After(redisFrees) {
		t.Errorf("after R's reply the hold expires at T2's send + %v, and no renewal went after T2's loss; "+
			"R was sent before T2 and may have run first, so Redis frees the lock by T2's send + 1 s "+
			"(reentryMayHaveRun returned early for T2, so since stayed at T1's failure, before R's send)",
			hd.expiresAt.Sub(t2Sent))
	}
	if !h.expiryFires(hd, lost, redisFrees) {
		t.Errorf("Lost still open when Redis may free the lock (T2's send + 1 s)")
	}
}

// The same gap without a doubt before: a re-entry whose lease does not end before
// the hold's current expiry records nothing, yet a renewal in flight, sent before
// it, may have run before it and then moves expiresAt past what the re-entry set.
// expiresAt is no longer a lower bound of the server's expiry; if the renewals
// that follow fail (the connection that lost T's reply is still bad), Lost closes
// after Redis has freed the lock.
//
//  1. Owner 1 holds L; the sweep at +7.5 s sends renewal R.
//  2. +7.501 s: TryLock T (lease 23 s): at = +30.501 s, not before +30 s.
//     T's reply is lost.
//  3. Redis ran R, then T: the lock expires at about +30.501 s.
//  4. R's reply (1): the hold expires at +37.5 s. Every later renewal fails.
//  5. At +30.501 s Redis frees the lock; Lost closes only at +37 s.
func TestMachineLongLostReentryAfterRenewalSentBeforeItOverstatesExpiry(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now

	r, rSent := h.sweepRenewal(t, start.Add(7500*time.Millisecond))

	h.now = h.now.Add(time.Millisecond)
	tSent := h.lostTry(t, 23*time.Second)
	pending := renewalsIn(h.take(), hd.id)
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // R ran before T
	pending = append(pending, renewalsIn(h.take(), hd.id)...)

	// From here on every renewal fails; sweeps run every 2.5 s.
	redisFrees := tSent.Add(23 * time.Second)
	for at := start.Add(10 * time.Second); at.Before(redisFrees); at = at.Add(2500 * time.Millisecond) {
		for _, c := range pending {
			h.replyAt(c, h.now, scripts.Reply{}, errConn)
		}
		pending = renewalsIn(h.take(), hd.id)
		h.now = at
		h.fire(sweepKey)
		pending = append(pending, renewalsIn(h.take(), hd.id)...)
	}
	for _, c := range pending {
		h.replyAt(c, h.now, scripts.Reply{}, errConn)
	}
	h.take()
	if !h.expiryFires(hd, lost, redisFrees) {
		t.Errorf("Lost still open at T's send + 23 s, when Redis frees the lock if R ran before T; "+
			"the hold expires at T's send + %v (R's reply, sent before T, was trusted)", hd.expiresAt.Sub(tSent))
	}
}

// One connection reset kills both a short re-entry T and the sweep's renewal R0
// in flight beside it. T's failure puts the hold in doubt, but R0 is still in
// flight, so no renewal goes; R0's reply is an error, and onRenewDone's d.err
// branch returns before the doubt is looked at: no renewal is ever sent after the
// failure, the next sweep (nextRenew is still +10 s) comes after the shortened
// deadline, and the hold is lost and its field released, although nothing may
// have run (the reset came first) and a renewal on the reconnected client would
// have kept it.
func TestMachineLostShortReentryRenewalErrorNotRetried(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now

	r0, r0Sent := h.sweepRenewal(t, start.Add(7500*time.Millisecond))
	h.now = h.now.Add(time.Millisecond)
	tSent := h.lostTry(t, time.Second)
	renewed := len(renewalsIn(h.take(), hd.id))
	h.replyAt(r0, r0Sent, scripts.Reply{}, errConn)
	renewed += len(renewalsIn(h.take(), hd.id))

	// The client reconnects; any renewal sent from now on would succeed. Walk to
	// the shortened deadline, firing whatever sweep falls before it.
	deadline := tSent.Add(time.Second)
	for at := start.Add(10 * time.Second); at.Before(deadline); at = at.Add(2500 * time.Millisecond) {
		h.now = at
		h.fire(sweepKey)
		renewed += len(renewalsIn(h.take(), hd.id))
	}
	h.now = deadline.Add(-expiryMargin(time.Second))
	h.fire(timerKeyExpiry(hd.id))
	s := h.take()
	if renewed == 0 {
		select {
		case <-lost:
			t.Errorf("the hold in doubt was lost at T's send + 950 ms (%d release(s) sent) without any renewal "+
				"sent after T's failure: R0's error (d.err) is not followed by renewDoubted, and the sweep waits "+
				"for nextRenew (+10 s)", len(s.calls(scripts.LockReleaseOwner)))
		default:
			t.Errorf("no renewal sent after T's failure")
		}
	}
}

// The same with the doubt's own renewal: R, sent at the failure, fails; the hold
// in doubt gets no other renewal before its shortened deadline, although two
// sweeps run before it (nextRenew is still +10 s away).
func TestMachineLostReentryDoubtRenewalErrorNotRetriedBySweep(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now

	h.now = start.Add(time.Second)
	tSent := h.lostTry(t, 5*time.Second)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now
	h.now = h.now.Add(5 * time.Millisecond)
	h.replyAt(r, rSent, scripts.Reply{}, errConn) // a transient error
	renewed := len(renewalsIn(h.take(), hd.id))

	deadline := tSent.Add(5 * time.Second)
	for at := start.Add(2500 * time.Millisecond); at.Before(deadline); at = at.Add(2500 * time.Millisecond) {
		h.now = at
		h.fire(sweepKey)
		renewed += len(renewalsIn(h.take(), hd.id))
	}
	h.now = deadline.Add(-expiryMargin(5 * time.Second))
	h.fire(timerKeyExpiry(hd.id))
	h.take()
	if renewed == 0 {
		select {
		case <-lost:
			t.Errorf("the hold in doubt was lost at T's send + 4.75 s after a single failed renewal; the sweeps " +
				"at +2.5 s and +5 s did not retry it (nextRenew +10 s)")
		default:
			t.Errorf("no renewal retried before the shortened deadline")
		}
	}
}

// A renewal sent after the failure (trusted) replies "held" while an Unlock of the
// same owner is in flight: it must be taken (onRenewDone once skipped it, and the
// next renewal came only at the Unlock's reply). With a short try lease (200 ms) an Unlock slower than the
// remaining ~190 ms sees the hold lost meanwhile, and its field released after the
// Unlock, although R confirmed the 30 s lease (Redis can only have the field with
// at least R's 30 s, or not at all, once R has said "held": only a re-entry could
// shorten it again, and its own reply would say so).
func TestMachineLostShortReentryTrustedRenewalDroppedWhileUnlockSlow(t *testing.T) {
	h, hd, _ := heldUnderWatchdog(t, 2)
	start := h.now
	lost := hd.lostSignal().C()

	h.now = start.Add(time.Second)
	tSent := h.lostTry(t, 200*time.Millisecond)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now

	h.now = h.now.Add(time.Millisecond)
	uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // R ran: 30 s from its run on Redis
	h.take()

	if h.expiryFires(hd, lost, tSent.Add(195*time.Millisecond)) {
		t.Errorf("the hold was lost at T's send + 195 ms while the Unlock was in flight, although renewal R, " +
			"sent after T's failure, replied \"held\" (skipped because the owner was busy)")
	}
	h.now = h.now.Add(50 * time.Millisecond)
	h.reply(uc, replyInt(0), nil)
	mustGranted(t, "unlock", u)
	h.take()
}
