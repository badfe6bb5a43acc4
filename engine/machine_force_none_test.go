package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// Owner 1's Lock A is sent (free lock); then ForceUnlock F is sent. Redis runs F
// first (another connection; or A's EVALSHA met NOSCRIPT and its EVAL went after
// F), which finds no lock and answers 0, then A, which takes L. A's reply is
// stepped first. F deleted nothing (existed = 0), so the hold cannot be its
// victim: it stands (a check may ask Redis, which answers that it is held).
func TestMachineForceThatFoundNothingSparesEarlierGrant(t *testing.T) {
	h := newMH(t)
	a, ac, aSent, f, fSent := acquireThenForce(t, h)
	h.replyAt(ac, aSent, replyNil, nil)
	mustGranted(t, "A", a.future)
	lost := h.hold("L", 1).lostSignal().C()
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(f, fSent, replyInt(0), nil)
	mustNotFired(t, "Lost of a hold a force-release that found no lock cannot have deleted", lost)
	if h.hold("L", 1) == nil {
		t.Fatal("hold dropped by a force-release that found no lock")
	}
	// Granted before the force-release's send, the hold may also have been gone
	// before it ran (its lease out): one check asks, and its answer keeps it.
	chk := h.take().one(t, scripts.LockRenew)
	if !chk.check {
		t.Fatalf("the renewal after the force-release is not a check: %+v", chk)
	}
	h.reply(chk, replyInts(1), nil)
	h.take()
	mustNotFired(t, "Lost after the check found the hold", lost)
	if h.hold("L", 1) == nil {
		t.Fatal("hold dropped after the check found it")
	}
}
