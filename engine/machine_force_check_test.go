package engine

import (
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A force-release's check is a PEXPIRE with the hold's own lease, guarded by the
// owner's field. With a lease shorter than a later acquire of the same field (a
// re-entry with a longer lease, or the owner's next Lock after an Unlock), Redis
// may run the check after that acquire and cut the key's expiry back to the
// check's lease. The engine must not believe the longer lease then.
//
//  1. F (force) is sent; owner 1 takes L with a 5 s lease; F's reply (1) sends
//     check C (PEXPIRE 5 s, field cid:1).
//  2. Owner 1 re-enters with a 20 s lease: R, answered granted.
//  3. Redis ran C after R: the key expires 5 s after C ran; C's reply is 1.
func TestMachineForceCheckShortLeaseAfterLongerReentry(t *testing.T) {
	for _, relock := range []bool{false, true} {
		h := newMH(t)
		f := newForce(h, "L")
		fSent := h.now
		h.now = h.now.Add(time.Millisecond)
		h.grantFresh("L", 1, 5*time.Second)
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(f, fSent, replyInt(1), nil)
		check := h.take().one(t, scripts.LockRenew)
		cSent := h.now
		if relock {
			// The owner unlocks and locks again (same field) instead of re-entering.
			h.now = h.now.Add(time.Millisecond)
			uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
			h.reply(uc, replyInt(1), nil)
			mustGet(t, "unlock", u)
			h.take()
		}
		h.now = h.now.Add(time.Millisecond)
		r := h.acquire("L", 1, 20*time.Second, -1)
		rc := h.take().one(t, scripts.LockAcquire)
		rSent := h.now
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(rc, rSent, replyNil, nil)
		mustGranted(t, "R", r.future)
		h.take()
		hd := h.hold("L", 1)
		lost := hd.lostSignal().C()
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(check, cSent, replyInts(1), nil) // ran after R: PEXPIRE 5 s
		h.take()
		ms, _ := strconv.Atoi(check.args[0])
		redisFrees := cSent.Add(time.Duration(ms) * time.Millisecond) // at the earliest
		if hd.expiresAt.After(redisFrees) {
			t.Errorf("relock=%v: hold expires at R's send + %v; the check (%s ms) may have run after R",
				relock, hd.expiresAt.Sub(rSent), check.args[0])
		}
		if !h.expiryFires(hd, lost, redisFrees) {
			t.Errorf("relock=%v: Lost still open at the check's send + %s ms, when Redis may have freed L",
				relock, check.args[0])
		}
	}
}

// A check in flight keeps a watchdog hold "renewing", so a lost re-entry's doubt
// (reentryMayHaveRun) sends no renewal: "the renewal in flight answers". But the
// check's reply skipped the doubt handling: no renewal went, and the hold was
// declared lost at the try's send + 1 s - margin, its field released, although
// the check (PEXPIRE 30 s), or a renewal sent after the doubt, kept it.
//
//  1. F is sent; owner 1 takes L under the watchdog; F's reply (1) sends check C.
//  2. Owner 1's TryLock T (lease 1 s) re-enters; its reply is lost.
//  3. C's reply: 1. A renewal must go (C was sent before T's loss was heard).
func TestMachineForceCheckRenewsDoubtedHold(t *testing.T) {
	h := newMH(t)
	f := newForce(h, "L")
	fSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.grantFresh("L", 1, 0)
	hd := h.hold("L", 1)
	lost := hd.lostSignal().C()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(f, fSent, replyInt(1), nil)
	check := h.take().one(t, scripts.LockRenew)
	cSent := h.now
	h.now = h.now.Add(time.Millisecond)
	tSent := h.lostTry(t, time.Second)
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(check, cSent, replyInts(1), nil)
	renewals := h.take().calls(scripts.LockRenew)
	if len(renewals) != 1 {
		t.Fatalf("no renewal after the check's reply for a hold whose lease is in doubt (sent %d)", len(renewals))
	}
	h.now = h.now.Add(time.Millisecond)
	h.reply(renewals[0], replyInts(1), nil)
	h.take()
	h.now = tSent.Add(600 * time.Millisecond)
	h.fire(timerKeyExpiry(hd.id))
	h.take()
	mustNotFired(t, "Lost of a hold renewed after the doubt", lost)
}

// A force-release whose reply is lost to a transport error may have run: it may
// have deleted this client's holds. Nothing checks them: a hold with a 1 min
// lease stays believed (Lost open, no call) while another client may hold L.
func TestMachineForceLostReplyChecksHolds(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, time.Minute)
	lost := h.hold("L", 1).lostSignal().C()
	h.now = h.now.Add(time.Millisecond)
	f := newForce(h, "L")
	fSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(f, fSent, scripts.Reply{}, errConn) // ran, then the connection failed
	checks := h.take().calls(scripts.LockRenew)
	select {
	case <-lost:
		return // ended: early is safe
	default:
	}
	if len(checks) != 1 {
		t.Fatalf("a force-release that may have run left the hold believed, unchecked (%d checks)", len(checks))
	}
	h.now = h.now.Add(time.Millisecond)
	h.reply(checks[0], replyInts(0), nil)
	h.take()
	mustFired(t, "Lost of a hold the force-release deleted", lost)
}

// A check's "not held" is set aside while the owner has a call in flight, which
// "decides instead". But an Unlock that ran before the force-release (count 2 -> 1)
// answers "still held" and decides nothing: the hold stayed believed, unchecked,
// with no field on Redis.
//
//  1. F is sent; owner 1 takes L (1 min) and re-enters: count 2.
//  2. Its Unlock U goes. Redis runs U (count 1), then F (deletes L).
//  3. F's reply (1) sends check C; C runs after F: 0, answered while U is in
//     flight: set aside.
//  4. U's reply: 0, still held. Nothing checks the hold again.
func TestMachineForceCheckSetAsideByUnlockThatRanBefore(t *testing.T) {
	h := newMH(t)
	f := newForce(h, "L")
	fSent := h.now
	h.now = h.now.Add(time.Millisecond)
	h.grantFresh("L", 1, time.Minute)
	h.acquire("L", 1, time.Minute, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	hd := h.hold("L", 1)
	if hd.count != 2 {
		t.Fatalf("setup: count %d", hd.count)
	}
	lost := hd.lostSignal().C()
	h.now = h.now.Add(time.Millisecond)
	uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(f, fSent, replyInt(1), nil)
	check := h.take().one(t, scripts.LockRenew)
	h.now = h.now.Add(time.Millisecond)
	h.reply(check, replyInts(0), nil) // ran after F
	h.take()
	h.reply(uc, replyInt(0), nil) // U ran before F
	mustGranted(t, "U", u)
	again := h.take().calls(scripts.LockRenew)
	select {
	case <-lost:
		return
	default:
	}
	if len(again) != 1 {
		t.Fatalf("the check found the field gone, its answer was set aside for U, and U's \"still held\" "+
			"left the hold (count %d) believed with no field on Redis and no check", hd.count)
	}
	h.now = h.now.Add(time.Millisecond)
	h.reply(again[0], replyInts(0), nil)
	h.take()
	mustFired(t, "Lost of a hold the force-release deleted", lost)
}
