package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
)

// A renewal in flight keeps a plain lock's state live after its last Unlock
// (renewsOut). A Lock of the other kind on the same name then failed with
// errKindMismatch, where an idle state would have been replaced. And the
// renewal must still count for the new state: it is guarded by the owner's field,
// "cid:1", which a fair hold of the same owner writes too.
//
//  1. Owner 1 holds plain L under the watchdog; the sweep sends renewal R.
//  2. Its Unlock releases L (the hold is dropped; R is still in flight).
//  3. Owner 1's fair TryLock S (lease 1 min) takes L under field cid:1.
//  4. Redis runs R after S: cid:1 exists, PEXPIRE 30 s.
func TestMachineRenewalInFlightCarriesToOtherKind(t *testing.T) {
	h, r, rSent := releasedWithRenewalOut(t)

	h.now = h.now.Add(time.Millisecond)
	h.nextID++
	s := futures.New[error]()
	h.m.handle(acquireMsg{id: h.nextID, lock: "L", owner: 1, fair: true, lease: time.Minute,
		ctx: context.Background(), future: s}, h.now)
	if err, done := peek(s); done && errors.Is(err, errKindMismatch) {
		t.Fatalf("fair TryLock failed with %v: only a renewal of a dropped plain hold was in flight", err)
	}
	sc := h.take().one(t, scripts.FairAcquire)
	h.grantThenLateRenewal(t, s, sc, h.now, r, rSent)
}

// ForceUnlock F is sent; then owner 1's Lock A (1 min lease) is sent and takes L
// ForceUnlock F is sent; then owner 1's Lock A (1 min lease) is sent and takes L
// fresh. Sent on different connections, Redis may run A first and then F, which
// deletes A's hold and answers 1 (existed); A's reply comes first. F's reply
// cannot tell whether A ran before it: the hold is checked (a renewal with its own
// lease, sent after both replies), and a "not held" ends it.
func TestMachineForceAfterLaterGrantChecksIt(t *testing.T) {
	for _, held := range []bool{false, true} {
		h := newMH(t)
		f := newForce(h, "L")
		fSent := h.now
		h.now = h.now.Add(time.Millisecond)
		h.grantFresh("L", 1, time.Minute)
		lost := h.hold("L", 1).lostSignal().C()
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(f, fSent, replyInt(1), nil)
		check := h.take().one(t, scripts.LockRenew)
		if got, want := check.args[0], "60000"; got != want {
			t.Errorf("check's lease %s, want the hold's own %s", got, want)
		}
		mustNotFired(t, "Lost before the check's reply", lost)
		h.now = h.now.Add(time.Millisecond)
		if held {
			h.reply(check, replyInts(1), nil) // A ran after F
			mustNotFired(t, "Lost of a hold the check found", lost)
			if h.hold("L", 1) == nil {
				t.Fatal("hold dropped although the check found it")
			}
			continue
		}
		h.reply(check, replyInts(0), nil) // A ran before F: deleted
		h.take()
		mustFired(t, "Lost of a hold the force-release deleted", lost)
	}
}

// acquireThenForce sends owner 1's Lock A on the free lock "L", then, a
// millisecond later, a ForceUnlock F; it returns A's waiter and call and F's call,
// with their send times.
func acquireThenForce(t *testing.T, h *mh) (a *tw, ac scriptCall, aSent time.Time, f scriptCall, fSent time.Time) {
	t.Helper()
	a = h.acquire("L", 1, time.Minute, -1)
	ac = h.take().one(t, scripts.LockAcquire)
	aSent = h.now
	h.now = h.now.Add(time.Millisecond)
	f = newForce(h, "L")
	fSent = h.now
	h.now = h.now.Add(time.Millisecond)
	return a, ac, aSent, f, fSent
}

// The same with A's reply coming after F's: F's reply finds no hold to check, and
// the grant, whose call was sent before F's reply came, is checked when it comes.
func TestMachineForceWhileGrantInFlightChecksIt(t *testing.T) {
	h := newMH(t)
	a, ac, aSent, f, fSent := acquireThenForce(t, h)
	h.replyAt(f, fSent, replyInt(1), nil) // ran after A: deleted A's hold
	h.take()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(ac, aSent, replyNil, nil)
	mustGranted(t, "A", a.future)
	lost := h.hold("L", 1).lostSignal().C()
	check := h.take().one(t, scripts.LockRenew)
	h.now = h.now.Add(time.Millisecond)
	h.reply(check, replyInts(0), nil)
	h.take()
	mustFired(t, "Lost of a hold the force-release deleted", lost)

	// A grant whose call was sent after F's reply ran after F: no check.
	h.now = h.now.Add(time.Millisecond)
	h.grantFresh("L", 2, time.Minute)
	if calls := h.take().calls(scripts.LockRenew); len(calls) != 0 {
		t.Errorf("a grant sent after the force-release's reply was checked")
	}
}
