package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// The renewal a doubt sends at once (renewDoubted) goes out just as the caller's
// next call may go too (a TryLock retried after its transport error, say). If
// that call re-enters with an explicit lease longer than the watchdog's, addHold
// dates the hold from it (and drops the doubt) and onRenewDone ignores the
// renewal's reply (explicit lease). But the renewal was sent before the
// re-entry, on Redis it may run after it, and lock_renew then sets the key's
// expiry to the watchdog's 30 s: the engine must not count on the re-entry's
// 60 s (addHold counts on the watchdog's 30 s from the re-entry's send while a
// renewal is in flight).
//
//  1. Owner 1 holds L under the watchdog.
//  2. +1 s: TryLock T (1 s) re-enters; its reply is lost: doubt, renewal R goes.
//  3. +1.006 s: TryLock S (60 s) of the same handle re-enters: granted.
//     h.lease = 60 s, expiresAt = S's send + 60 s.
//  4. Redis ran S, then R (pexpire 30 s): R's reply 1, ignored.
//  5. About 30 s after S ran, Redis may have freed L; Lost is still open.
func TestMachineDoubtRenewalOverridesLongerReentryLease(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now

	h.now = start.Add(time.Second)
	h.lostTry(t, time.Second)
	r := h.take().one(t, scripts.LockRenew) // the doubt's renewal
	rSent := h.now

	h.now = h.now.Add(time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	if sc.args[0] != "60000" {
		t.Fatalf("setup: S's lease argument %q", sc.args[0])
	}
	sSent := h.now
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil) // S ran first: count 2 (3 with T's), pexpire 60 s
	mustGranted(t, "S", s)
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // then R: pexpire 30 s
	h.take()

	redisFrees := sSent.Add(30 * time.Second) // at the earliest: R ran after S, which ran at or after its send
	if hd.expiresAt.After(redisFrees) {
		t.Errorf("the hold expires at S's send + %v; renewal R (sent before S, answered after it) may have run "+
			"after S and set the key's expiry to 30 s, so Redis may free L at S's send + 30 s",
			hd.expiresAt.Sub(sSent))
	}
	if !h.expiryFires(hd, lost, redisFrees) {
		t.Errorf("Lost still open at S's send + 30 s, when Redis may have freed L")
	}
}

// A failed re-entry's doubt must send its renewal even when its owner is busy
// again at once, with an Unlock that waited for the try: waiting for the owner to
// be idle (as the doubt's renewal once did) left the sweep's renewal at nextRenew
// (+10 s), and the hold was lost at the shortened deadline, its field released,
// although Redis kept it. The renewal's "held", answered while the Unlock is in
// flight, is taken (a doubted hold takes it while its owner is busy).
//
//  1. Owner 1 holds L (count 2) under the watchdog.
//  2. +1 s: TryLock T (200 ms); an Unlock U of the same handle waits behind it.
//  3. T's reply is lost: expiry brought forward to T's send + 200 ms; U and a
//     renewal R go.
//  4. R says held while U is in flight; at T's send + 195 ms the expiry entry
//     fires: the hold is not lost.
func TestMachineDoubtRenewalNotSentWhileWaitingCallKeepsOwnerBusy(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 2)
	start := h.now

	h.now = start.Add(time.Second)
	h.tryLease("L", 1, 200*time.Millisecond)
	tc := h.take().one(t, scripts.LockAcquire)
	tSent := h.now
	u := h.unlock("L", 1) // waits for T
	h.take().none(t)
	h.now = h.now.Add(5 * time.Millisecond)
	h.replyAt(tc, tSent, scripts.Reply{}, errConn)
	st := h.take()
	ucs := st.calls(scripts.LockRelease)
	if len(ucs) != 1 {
		t.Fatalf("after T's failure: %d releases, want U's one", len(ucs))
	}
	uc := ucs[0]
	rs := renewalsIn(st, hd.id)
	if len(rs) != 1 {
		t.Fatalf("after T's failure, with the Unlock that waited for T sent: %d renewals of the hold in doubt, want 1", len(rs))
	}
	rSent := h.now
	h.now = h.now.Add(10 * time.Millisecond)
	h.replyAt(rs[0], rSent, replyInts(1), nil) // held, U still in flight
	h.take()

	if h.expiryFires(hd, lost, tSent.Add(195*time.Millisecond)) {
		t.Errorf("the hold in doubt was lost at T's send + 195 ms although its renewal, sent after T's failure, said held")
	}
	h.now = h.now.Add(10 * time.Millisecond)
	h.reply(uc, replyInt(0), nil)
	mustGet(t, "unlock", u)
	h.take()
}

// The same without any doubt: the sweep's renewal in flight and a re-entry with a
// lease longer than the watchdog's. (The root of the test above predates the
// doubts; renewDoubted makes the race routine by sending its renewal exactly when
// the owner's next call goes.)
func TestMachineSweepRenewalOverridesLongerReentryLease(t *testing.T) {
	h, hd, _ := heldUnderWatchdog(t, 1)
	start := h.now
	r, rSent := h.sweepRenewal(t, start.Add(7500*time.Millisecond))
	h.now = h.now.Add(time.Millisecond)
	s := h.tryLease("L", 1, time.Minute)
	sc := h.take().one(t, scripts.LockAcquire)
	sSent := h.now
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(sc, sSent, replyNil, nil)
	mustGranted(t, "S", s)
	h.take()
	h.replyAt(r, rSent, replyInts(1), nil) // R ran after S: 30 s
	h.take()
	// R ran after S, which ran at or after its send: Redis may free L 30 s after that.
	if redisFrees := sSent.Add(30 * time.Second); hd.expiresAt.After(redisFrees) {
		t.Errorf("the hold expires at S's send + %v; Redis may free L at S's send + 30 s", hd.expiresAt.Sub(sSent))
	}
}
