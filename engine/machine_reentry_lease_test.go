package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A handle held under the watchdog is re-entered, by another goroutine sharing
// it, with a 30 ms lease. When the re-entry runs, the script sets the lock's
// expiry to 30 ms for the whole hold; if its reply takes longer than that, the
// goroutine already inside must still hear from Lost before the key can expire.
// So the hold's expiry comes forward when the re-entry is sent (shortenForReentry),
// with the short lease's margin, and no renewal moves it back while the re-entry
// is in flight. (The simulations met this as seeds 3042 and 199.)
func TestMachineShortReentryShortensHold(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0) // under the watchdog
	hd := h.hold("L", 1)
	lost := hd.lostSignal().C()
	sent := h.now

	h.acquire("L", 1, 30*time.Millisecond, -1) // the partner's re-entry
	s := h.take()
	re := s.one(t, scripts.LockAcquire)
	if want := sent.Add(30 * time.Millisecond); hd.expiresAt.After(want) {
		t.Fatalf("with a 30 ms re-entry in flight the hold counts on %v more, want at most 30 ms",
			hd.expiresAt.Sub(sent))
	}
	exp := s.armed(kindExpiry)
	if len(exp) == 0 {
		t.Fatalf("no expiry armed for the shortened hold: %v", s)
	}
	if d := exp[len(exp)-1].d; d > 30*time.Millisecond-expiryMargin(30*time.Millisecond) {
		t.Fatalf("expiry armed in %v, want the 30 ms lease less its margin", d)
	}

	// A renewal answered while the re-entry is in flight does not move it back.
	h.now = h.now.Add(10 * time.Millisecond)
	h.m.renew([]*hold{hd})
	ren := h.take().one(t, scripts.LockRenew)
	h.reply(ren, scripts.Reply{Ints: []int64{1}}, nil)
	h.take()
	if hd.expiresAt.After(sent.Add(30 * time.Millisecond)) {
		t.Fatalf("a renewal answered during the re-entry moved the expiry to %v after its send", hd.expiresAt.Sub(sent))
	}

	// The re-entry's reply is late: the expiry fires first, and Lost closes.
	h.now = sent.Add(30*time.Millisecond - expiryMargin(30*time.Millisecond))
	h.fire(exp[len(exp)-1].key)
	mustFired(t, "the hold's Lost, its lock's key expiring with the re-entry's lease", lost)

	// The reply comes at last: the re-entry's grant is a new hold, on its lease.
	h.now = sent.Add(40 * time.Millisecond)
	h.reply(re, replyNil, nil)
	h.take()
	if nh := h.hold("L", 1); nh == nil || nh.id == hd.id || nh.lease != 30*time.Millisecond {
		t.Fatalf("after the late grant: hold %+v, want a new hold on the 30 ms lease", nh)
	}
}
