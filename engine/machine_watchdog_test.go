package engine

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Layer 1: the watchdog (batched renewals, lease expiry), resubscription and
// shutdown.

var sweepKey = timer.Key{Kind: kindSweep}

// checkRenew checks one lock_renew call's shape: the lease first, then one owner
// field per key, matching the holds the call names.
func checkRenew(t *testing.T, h *mh, c scriptCall) {
	t.Helper()
	if len(c.keys) == 0 || len(c.keys) > renewBatch {
		t.Fatalf("renewal of %d holds, want 1..%d", len(c.keys), renewBatch)
	}
	if len(c.args) != len(c.keys)+1 || c.args[0] != "30000" || len(c.batch) != len(c.keys) {
		t.Fatalf("renewal args %d (lease %q), batch %d, for %d keys", len(c.args), c.args[0], len(c.batch), len(c.keys))
	}
	for i, id := range c.batch {
		hd := h.m.holdByID[id]
		if hd == nil || hd.lock.name != c.keys[i] || hd.field != c.args[i+1] {
			t.Fatalf("renewal entry %d: key %q field %q, hold %+v", i, c.keys[i], c.args[i+1], hd)
		}
	}
}

func TestMachineSweepBatches(t *testing.T) {
	const n = 250
	h := newMH(t)
	start := h.now
	for i := range n {
		h.grantFresh(fmt.Sprintf("L%d", i), uint64(i+1), 0)
	}

	// The first sweep, a quarter period in: nothing is due yet.
	h.now = start.Add(30 * time.Second / 12)
	h.fire(sweepKey)
	s := h.take()
	s.none(t)
	if len(s.armed(kindSweep)) != 1 {
		t.Fatalf("sweep not re-armed: %v", s)
	}

	// Renewals are due at lease/3 = 10 s; the sweep at 8 s looks 2.5 s ahead.
	h.now = start.Add(8 * time.Second)
	h.fire(sweepKey)
	s = h.take()
	calls := s.calls(scripts.LockRenew)
	if len(calls) != 3 || len(s.scripts) != 3 {
		t.Fatalf("%d holds renewed in %d calls (%d scripts), want 3", n, len(calls), len(s.scripts))
	}
	seen := map[uint64]bool{}
	for _, c := range calls {
		checkRenew(t, h, c)
		for _, id := range c.batch {
			if seen[id] {
				t.Fatalf("hold %d renewed twice in one sweep", id)
			}
			seen[id] = true
		}
	}
	if len(seen) != n {
		t.Fatalf("%d holds renewed, want %d", len(seen), n)
	}
	if len(s.armed(kindSweep)) != 1 {
		t.Fatalf("sweep not re-armed: %v", s)
	}

	// Holds with a renewal in flight are not renewed again.
	h.now = h.now.Add(30 * time.Second / 12)
	h.fire(sweepKey)
	h.take().none(t)

	// Replies: one hold in the last batch is gone on the server.
	var lostID uint64
	for i, c := range calls {
		ones := slices.Repeat([]int64{1}, len(c.keys))
		if i == len(calls)-1 {
			ones[0] = 0
			lostID = c.batch[0]
		}
		h.replyAt(c, start.Add(8*time.Second), replyInts(ones...), nil)
	}
	s = h.take()
	if h.m.holdByID[lostID] != nil {
		t.Fatal("hold renewed with 0 kept")
	}
	s.none(t) // the lost hold's owner field is already gone: nothing to release
	if got := len(s.armed(kindExpiry)); got != n-1 {
		t.Errorf("%d expiry timers re-armed, want %d", got, n-1)
	}
	for _, hd := range h.m.holdByID {
		if want := start.Add(38 * time.Second); !hd.expiresAt.Equal(want) {
			t.Fatalf("hold %d expires at %v, want %v", hd.id, hd.expiresAt, want)
		}
	}
}

func TestMachineRenewal(t *testing.T) {
	t.Run("success moves the deadline", func(t *testing.T) {
		h := newMH(t)
		start := h.now
		h.grantFresh("L", 1, 0)
		hd := h.hold("L", 1)
		if want := start.Add(30 * time.Second); !hd.expiresAt.Equal(want) {
			t.Fatalf("expiresAt %v, want %v", hd.expiresAt, want)
		}
		h.now = start.Add(9 * time.Second)
		h.fire(sweepKey)
		c := h.take().one(t, scripts.LockRenew)
		checkRenew(t, h, c)
		h.now = start.Add(9*time.Second + 3*time.Millisecond) // the reply's round trip
		h.replyAt(c, start.Add(9*time.Second), replyInts(1), nil)
		s := h.take()
		if want := start.Add(39 * time.Second); !hd.expiresAt.Equal(want) {
			t.Errorf("expiresAt %v, want %v (send time + lease)", hd.expiresAt, want)
		}
		want := start.Add(39*time.Second - 500*time.Millisecond).Sub(h.now)
		if ops := s.armed(kindExpiry); len(ops) != 1 || ops[0].d != want {
			t.Errorf("expiry re-armed %+v, want one in %v", ops, want)
		}
		if !hd.nextRenew.Equal(start.Add(19 * time.Second)) {
			t.Errorf("next renewal %v, want %v", hd.nextRenew, start.Add(19*time.Second))
		}
	})
	t.Run("reply 0 closes Lost", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		waiter := h.acquire("L", 2, 0, -1)
		h.take()
		lost := h.hold("L", 1).lostSignal().C()
		h.now = h.now.Add(9 * time.Second)
		h.fire(sweepKey)
		h.reply(h.take().one(t, scripts.LockRenew), replyInts(0), nil)
		mustFired(t, "Lost", lost)
		if h.hold("L", 1) != nil {
			t.Error("hold kept")
		}
		if err := mustGet(t, "unlock after loss", h.unlock("L", 1)); !errors.Is(err, ErrNotHeld) {
			t.Errorf("unlock after loss: %v, want ErrNotHeld", err)
		}
		// The local waiter no longer waits behind a local hold: it tries.
		s := h.take()
		if cs := s.calls(scripts.LockAcquire); len(cs) != 1 || cs[0].waiter != waiter.id {
			t.Errorf("want one attempt by the waiter, got: %v", s)
		}
	})
	t.Run("transport error leaves the hold to the next sweep", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		lost := h.hold("L", 1).lostSignal().C()
		h.now = h.now.Add(9 * time.Second)
		h.fire(sweepKey)
		h.reply(h.take().one(t, scripts.LockRenew), scripts.Reply{}, errConn)
		mustNotFired(t, "Lost", lost)
		h.take()
		h.now = h.now.Add(30 * time.Second / 12)
		h.fire(sweepKey)
		h.take().one(t, scripts.LockRenew)
	})
	t.Run("explicit lease is not renewed", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("W", 1, 0)
		h.grantFresh("E", 2, 60*time.Second)
		h.now = h.now.Add(9 * time.Second)
		h.fire(sweepKey)
		c := h.take().one(t, scripts.LockRenew)
		if !slices.Equal(c.keys, []string{"W"}) {
			t.Errorf("renewed %v, want only the watchdog hold", c.keys)
		}
	})
	t.Run("sweep stops with the last watchdog hold", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.reply(c, replyInt(1), nil)
		h.take()
		h.now = h.now.Add(30 * time.Second / 12)
		h.fire(sweepKey)
		if s := h.take(); len(s.armed(kindSweep)) != 0 || len(s.scripts) != 0 {
			t.Errorf("sweep with no watchdog hold: %v", s)
		}
	})
}

// The expiry timer guards the lease: past the deadline (minus the safety margin) the
// hold is lost, its Lost closes, and the owner's field is released in case it is
// still there.
func TestMachineExpiry(t *testing.T) {
	tests := []struct {
		name     string
		lease    time.Duration
		deadline time.Duration // after the grant
	}{
		{"explicit lease", 5 * time.Second, 5*time.Second - 250*time.Millisecond},
		{"watchdog without renewal", 0, 30*time.Second - 500*time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t)
			start := h.now
			h.grantFresh("L", 1, tt.lease)
			hd := h.hold("L", 1)
			key := timer.Key{Kind: kindExpiry, ID: hd.id}
			lost := hd.lostSignal().C()

			h.now = start.Add(time.Second) // early
			h.fire(key)
			s := h.take()
			if ops := s.armed(kindExpiry); len(ops) != 1 || ops[0].d != tt.deadline-time.Second {
				t.Fatalf("early expiry re-armed %+v, want one in %v", ops, tt.deadline-time.Second)
			}
			mustNotFired(t, "Lost", lost)
			s.none(t)

			h.now = start.Add(tt.deadline)
			h.fire(key)
			mustFired(t, "Lost", lost)
			c := h.take().one(t, scripts.LockReleaseOwner)
			if want := []string{"0", "cid:1", "0"}; !slices.Equal(c.args, want) {
				t.Errorf("release_owner args %v, want %v", c.args, want)
			}
			if h.hold("L", 1) != nil {
				t.Error("hold kept")
			}
			// Nothing to release: the answer does not wait for the clean-up.
			if err := mustGet(t, "unlock", h.unlock("L", 1)); !errors.Is(err, ErrNotHeld) {
				t.Errorf("unlock after expiry: %v, want ErrNotHeld", err)
			}
		})
	}
}

// After a resubscription every lock with waiters retries its head once; a lock whose
// attempt is in flight retries once more after it.
func TestMachineResubscribed(t *testing.T) {
	h := newMH(t)
	// Two locks with waiters parked behind local holders, one held without waiters.
	h.grantFresh("A", 100, 0)
	a1 := h.acquire("A", 1, 0, -1)
	h.acquire("A", 2, 0, -1)
	h.grantFresh("B", 101, 0)
	b1 := h.acquire("B", 3, 0, -1)
	h.grantFresh("C", 102, 0)
	// One lock with an attempt in flight.
	d1 := h.acquire("D", 4, 0, -1)
	dAtt := h.take().one(t, scripts.LockAcquire)

	h.m.handle(resubscribed{}, h.now)
	s := h.take()
	var got []uint64
	for _, c := range s.calls(scripts.LockAcquire) {
		got = append(got, c.waiter)
	}
	slices.Sort(got)
	if want := []uint64{a1.id, b1.id}; !slices.Equal(got, want) || len(s.scripts) != 2 {
		t.Fatalf("resubscription retried waiters %v, want the heads %v: %v", got, want, s)
	}
	if !h.lock("D").wakePending {
		t.Fatal("lock with an attempt in flight not marked to retry")
	}
	h.reply(dAtt, replyPTTL(5*time.Second), nil)
	if c := h.take().one(t, scripts.LockAcquire); c.waiter != d1.id {
		t.Fatalf("retry by %d, want %d", c.waiter, d1.id)
	}
}

func TestMachineClose(t *testing.T) {
	h := newMH(t)
	// A: held with the watchdog, one waiter parked behind it, subscribed.
	h.grantFresh("A", 1, 0)
	parked := h.acquire("A", 2, 0, -1)
	h.take()
	h.subscribed("A")
	if s := h.take(); len(s.scripts) == 1 { // the subscription's retry, refused
		h.reply(s.scripts[0], replyPTTL(30*time.Second), nil)
	}
	h.take()
	// B: an attempt in flight.
	inflight := h.acquire("B", 3, 0, -1)
	bAtt := h.take().one(t, scripts.LockAcquire)
	// C: held with an explicit lease.
	h.grantFresh("C", 4, 10*time.Second)
	lostA, lostC := h.hold("A", 1).lostSignal().C(), h.hold("C", 4).lostSignal().C()

	h.m.handle(closeMsg{}, h.now)
	s := h.take()
	if err := mustGet(t, "parked waiter", parked.future); !errors.Is(err, ErrClosed) {
		t.Fatalf("parked waiter got %v, want ErrClosed", err)
	}
	mustPending(t, "waiter with attempt in flight", inflight.future)
	mustFired(t, "Lost of A", lostA)
	mustFired(t, "Lost of C", lostC)
	var released []string
	for _, c := range s.calls(scripts.LockReleaseOwner) {
		if c.args[2] != "0" {
			t.Errorf("close released %v of %s, want all (0)", c.args[2], c.args[1])
		}
		released = append(released, c.keys[0]+"="+c.args[1])
	}
	slices.Sort(released)
	if want := []string{"A=cid:1", "C=cid:4"}; !slices.Equal(released, want) || len(s.scripts) != 2 {
		t.Errorf("close released %v, want %v: %v", released, want, s)
	}
	if us := s.unsubscribes(); len(us) != 1 || us[0].channel != channelName("A") {
		t.Errorf("unsubscribes %+v, want A's channel", us)
	}
	if len(s.cancelled(kindSweep)) != 1 {
		t.Errorf("sweep not cancelled: %v", s)
	}

	// The attempt in flight comes back granted: given back at once.
	h.reply(bAtt, replyNil, nil)
	if err := mustGet(t, "waiter with attempt in flight", inflight.future); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
	if c := h.take().one(t, scripts.LockReleaseOwner); c.keys[0] != "B" || c.args[2] != "1" {
		t.Errorf("release %v %v, want one hold of B", c.keys, c.args)
	}

	// Calls after close.
	late := h.acquire("D", 5, 0, -1)
	if err := mustGet(t, "acquire after close", late.future); !errors.Is(err, ErrClosed) {
		t.Errorf("acquire after close: %v", err)
	}
	if err := mustGet(t, "unlock after close", h.unlock("A", 1)); !errors.Is(err, ErrClosed) {
		t.Errorf("unlock after close: %v", err)
	}
	h.take().none(t)
	if st := h.m.snapshot(); st.Waiters != 0 || st.Holds != 0 || st.Receipts != 0 {
		t.Errorf("stats after close %+v", st)
	}
}

// Leases go to PEXPIRE in whole milliseconds, never 0 (PEXPIRE 0 deletes the key).
func TestMillis(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0: "1", time.Microsecond: "1", time.Millisecond: "1", 1500 * time.Microsecond: "1", 30 * time.Second: "30000",
	} {
		if got := millis(d); got != want {
			t.Errorf("millis(%v) = %s, want %s", d, got, want)
		}
	}
}
