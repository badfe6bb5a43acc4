package engine

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Layer 1: force unlock, the subscription's life cycle, and requests that arrive
// already cancelled.

func TestMachineForceUnlock(t *testing.T) {
	force := func(h *mh) *futures.Future[forceResult] {
		f := futures.New[forceResult]()
		h.m.handle(forceUnlockMsg{lock: "L", future: f}, h.now)
		return f
	}
	t.Run("held locally", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		lost := h.hold("L", 1).lostSignal().C()
		f := force(h)
		c := h.take().one(t, scripts.LockForceRelease)
		if !slices.Equal(c.keys, []string{"L", "redisson_lock__channel:{L}"}) || !slices.Equal(c.args, []string{"0"}) {
			t.Errorf("force keys %v args %v", c.keys, c.args)
		}
		h.reply(c, replyInt(1), nil)
		select {
		case r := <-f.C():
			if !r.existed || r.err != nil {
				t.Errorf("force result %+v, want existed", r)
			}
		default:
			t.Fatal("force not answered")
		}
		mustFired(t, "Lost", lost)
		if h.hold("L", 1) != nil {
			t.Error("hold kept after force")
		}
		if h.live("L") {
			t.Error("lock state kept")
		}
	})
	t.Run("absent", func(t *testing.T) {
		h := newMH(t)
		f := force(h)
		h.reply(h.take().one(t, scripts.LockForceRelease), replyInt(0), nil)
		if r := <-f.C(); r.existed || r.err != nil {
			t.Errorf("force result %+v, want not existed", r)
		}
	})
	t.Run("error", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		f := force(h)
		h.reply(h.take().one(t, scripts.LockForceRelease), scripts.Reply{}, errConn)
		if r := <-f.C(); !errors.Is(r.err, errConn) {
			t.Errorf("force result %+v, want the error", r)
		}
		if h.hold("L", 1) == nil {
			t.Error("hold dropped on a failed force")
		}
	})
}

// One subscription per lock: subscribed when the first waiter parks, kept for the
// linger period after the last one leaves, reused by a waiter that comes back in
// time, and never subscribed while an unsubscribe is in flight.
func TestMachineSubscriptionLifecycle(t *testing.T) {
	t.Run("linger", func(t *testing.T) {
		h := newMH(t, func(c *config) { c.linger = 250 * time.Millisecond })
		holder := h.grantFresh("L", 100, 0)
		a := h.acquire("L", 1, 0, -1)
		if subs := h.take().subscribes(); len(subs) != 1 {
			t.Fatalf("first parked waiter: %d subscribes, want 1", len(subs))
		}
		h.subscribed("L")
		if s := h.take(); len(s.scripts) == 1 { // the subscription's retry, refused
			h.reply(s.scripts[0], replyPTTL(30*time.Second), nil)
		}
		h.take()
		b := h.acquire("L", 2, 0, -1)
		if s := h.take(); len(s.subs) != 0 {
			t.Fatalf("second waiter subscribed again: %v", s)
		}

		h.cancelCtx(a)
		h.cancelCtx(b)
		s := h.take()
		if len(s.unsubscribes()) != 0 {
			t.Fatalf("unsubscribed at once despite linger: %v", s)
		}
		linger := s.armed(kindLinger)
		if len(linger) != 1 || linger[0].d != 250*time.Millisecond {
			t.Fatalf("linger timer %+v, want one of 250ms", linger)
		}

		// A waiter within the linger period reuses the subscription.
		c := h.acquire("L", 3, 0, -1)
		s = h.take()
		if len(s.subs) != 0 || len(s.cancelled(kindLinger)) != 1 {
			t.Fatalf("returning waiter: %v, want no subscribe and the linger cancelled", s)
		}
		h.fire(linger[0].key) // stale now
		if s := h.take(); len(s.subs) != 0 {
			t.Fatalf("stale linger unsubscribed: %v", s)
		}

		h.cancelCtx(c)
		linger = h.take().armed(kindLinger)
		if len(linger) != 1 {
			t.Fatal("linger not armed after the last waiter left")
		}
		h.fire(linger[0].key)
		if us := h.take().unsubscribes(); len(us) != 1 {
			t.Fatalf("linger ran out: %d unsubscribes, want 1", len(us))
		}
		h.m.handle(unsubscribeDone{lock: h.lockID("L")}, h.now)
		c2, _ := h.unlockCall(t, "L", holder.owner, scripts.LockRelease)
		h.reply(c2, replyInt(1), nil)
		if h.live("L") {
			t.Error("idle lock state kept")
		}
	})
	t.Run("subscribe waits for the unsubscribe in flight", func(t *testing.T) {
		h := newMH(t) // linger 0
		h.grantFresh("L", 100, 0)
		a := h.acquire("L", 1, 0, -1)
		h.take()
		h.subscribed("L")
		if s := h.take(); len(s.scripts) == 1 {
			h.reply(s.scripts[0], replyPTTL(30*time.Second), nil)
		}
		h.take()
		h.cancelCtx(a)
		if us := h.take().unsubscribes(); len(us) != 1 {
			t.Fatalf("%d unsubscribes, want 1", len(us))
		}
		h.acquire("L", 2, 0, -1)
		if s := h.take(); len(s.subs) != 0 {
			t.Fatalf("subscribed while the unsubscribe is in flight: %v", s)
		}
		h.m.handle(unsubscribeDone{lock: h.lockID("L")}, h.now)
		if subs := h.take().subscribes(); len(subs) != 1 {
			t.Fatalf("%d subscribes after the unsubscribe came back, want 1", len(subs))
		}
	})
}

func TestMachineAlreadyCancelled(t *testing.T) {
	t.Run("acquire", func(t *testing.T) {
		h := newMH(t)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		f := futures.New[error]()
		stops := 0
		h.m.handle(acquireMsg{id: 1, lock: "L", owner: 1, wait: -1, ctx: ctx, stop: func() bool { stops++; return true }, future: f}, h.now)
		if err := mustGet(t, "acquire", f); err != context.Canceled {
			t.Fatalf("got %v, want context.Canceled", err)
		}
		if stops != 1 {
			t.Errorf("AfterFunc unregistered %d times, want 1", stops)
		}
		h.take().none(t)
		if h.live("L") {
			t.Error("lock state created for a cancelled request")
		}
	})
	t.Run("queued waiter whose cancellation has not arrived", func(t *testing.T) {
		// The context ended; its cancelMsg is still on its way. A handoff skips it.
		h := newMH(t)
		holder := h.grantFresh("L", 100, 0)
		a := h.acquire("L", 1, 0, -1)
		b := h.acquire("L", 2, 0, -1)
		h.take()
		a.cancel()
		h.unlock("L", holder.owner)
		c := h.take().one(t, scripts.LockHandoff)
		if c.waiter != b.id {
			t.Fatalf("handoff to %d, want %d (the waiter whose context is alive)", c.waiter, b.id)
		}
		if err := mustGet(t, "cancelled waiter", a.future); err != context.Canceled {
			t.Fatalf("cancelled waiter got %v", err)
		}
		h.m.handle(cancelMsg{id: a.id, err: context.Canceled}, h.now) // arrives late: nothing to do
		h.take().none(t)
	})
}

// Stale and foreign messages change nothing.
func TestMachineIgnoresStrayMessages(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	h.m.handle(unlockNotice{channel: "redisson_lock__channel:{nobody}", payload: "0"}, h.now)
	h.notice("L") // no waiters
	h.m.handle(subscribeDone{lock: 999}, h.now)
	h.m.handle(unsubscribeDone{lock: 999}, h.now)
	h.m.handle(cancelMsg{id: 999, err: context.Canceled}, h.now)
	h.fire(timer.Key{Kind: kindRetry, ID: h.lockID("L"), Gen: 12345})
	h.take().none(t)
	if h.hold("L", 1) == nil {
		t.Fatal("hold lost")
	}
}

func TestMachineDescribeLock(t *testing.T) {
	h := newMH(t)
	describe := func() string {
		f := futures.New[string]()
		h.m.handle(describeMsg{lock: "L", future: f}, h.now)
		return <-f.C()
	}
	if got := describe(); !strings.Contains(got, "L: no state") {
		t.Errorf("before any use: %q", got)
	}
	h.grantFresh("L", 1, 0)
	h.acquire("L", 2, 0, -1) // queued behind the local hold
	h.take()
	got := describe()
	for _, want := range []string{"hold owner 1 count 1", "1 waiters [w", "owner 2 refused false"} {
		if !strings.Contains(got, want) {
			t.Errorf("describe = %q, want it to contain %q", got, want)
		}
	}
}
