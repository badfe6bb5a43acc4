package engine

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// A reused idle state backs off from minBackoff, as a fresh state does, not from
// an earlier run of transport errors.
func TestMachineReusedIdleStateBacksOffAfresh(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	for range 8 {
		h.reply(att, scripts.Reply{}, errConn)
		op := h.take().retryArmed(t)
		h.fire(op.key)
		att = h.take().one(t, scripts.LockAcquire)
	}
	h.reply(att, replyNil, nil)
	mustGranted(t, "grant", w.future)
	c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.reply(c, replyInt(1), nil)
	h.take()
	if l := h.m.locks["L"]; l == nil || !l.idle {
		t.Fatal("setup: state not idle")
	}
	// Reuse: the first transport error should back off minBackoff, as on a fresh state.
	h.acquire("L", 2, 0, -1)
	att = h.take().one(t, scripts.LockAcquire)
	h.reply(att, scripts.Reply{}, errConn)
	if op := h.take().retryArmed(t); op.d != minBackoff {
		t.Errorf("first transport error on a reused idle state backs off %v, a fresh state %v", op.d, minBackoff)
	}
}

// An idle state keeps no pointer to its last hold (nor its signal and field).
func TestMachineIdleStateHoldsNoHold(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.reply(c, replyInt(1), nil)
	l := h.m.locks["L"]
	if full := l.holders[:cap(l.holders)]; len(full) > 0 && full[0] != nil {
		t.Errorf("idle state still references dropped hold %d (and its signal, receipts, field)", full[0].id)
	}
}

// flipCtx's Err is nil on the first call and Canceled afterwards: the caller's
// deadline passing between onAcquire's check and advance's pruneCancelled.
type flipCtx struct {
	context.Context
	n atomic.Int32
}

func (c *flipCtx) Err() error {
	if c.n.Add(1) > 1 {
		return context.Canceled
	}
	return nil
}

// A waiter pruned by advance as soon as it queued (its context ended between
// onAcquire's check and advance) leaves its lock state to go idle, not live forever.
func TestMachineWaiterPrunedAtOnceLeavesStateIdle(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.reply(c, replyInt(1), nil)
	h.take()
	f := futures.New[error]()
	h.m.handle(acquireMsg{id: 77, lock: "L", owner: 2, wait: -1, ctx: &flipCtx{Context: context.Background()}, future: f}, h.now)
	if err := mustGet(t, "pruned waiter", f); err != context.Canceled {
		t.Fatalf("got %v", err)
	}
	h.now = h.now.Add(3 * idleKeep)
	h.fire(timer.Key{Kind: kindForget})
	if st := h.m.snapshot(); st.Locks != 0 || h.m.locks["L"] != nil {
		t.Errorf("unused state kept live forever: Stats.Locks=%d, state %+v", st.Locks, h.m.locks["L"])
	}
}

// A state used and left idle over and over is in the idle queue once, and the
// queue empties once nothing is idle.
func TestMachineIdleQueueHoldsEachStateOnce(t *testing.T) {
	h := newMH(t)
	for range 50 {
		h.grantFresh("L", 1, 0)
		c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.reply(c, replyInt(1), nil)
		h.take()
	}
	if n := len(h.m.idleQueue); n != 1 {
		t.Fatalf("idle queue holds %d entries for one state, want 1", n)
	}
	h.now = h.now.Add(idleKeep)
	h.fire(timer.Key{Kind: kindForget})
	if h.m.locks["L"] != nil || len(h.m.idleQueue) != 0 || h.m.idleLocks != 0 {
		t.Fatalf("after idleKeep: state %v, queue %d, idle count %d; want all gone", h.m.locks["L"], len(h.m.idleQueue), h.m.idleLocks)
	}
	if s := h.take(); len(s.armed(kindForget)) != 0 {
		t.Errorf("forget timer re-armed with nothing queued: %v", s)
	}
}
