package engine

import (
	"errors"
	"testing"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// An unused lock state is kept idle for reuse, then dropped by the forget timer.
func TestMachineIdleLockStates(t *testing.T) {
	cycle := func(h *mh, name string, owner uint64) {
		t.Helper()
		h.grantFresh(name, owner, 0)
		c, _ := h.unlockCall(t, name, owner, scripts.LockRelease)
		h.reply(c, replyInt(1), nil)
		h.take()
	}

	t.Run("reused, then forgotten", func(t *testing.T) {
		h := newMH(t)
		cycle(h, "L", 1)
		l := h.m.locks["L"]
		if l == nil || !l.idle || h.live("L") {
			t.Fatalf("after the release: state %+v, want kept idle", l)
		}
		if st := h.m.snapshot(); st.Locks != 0 {
			t.Errorf("Stats.Locks = %d with only an idle state, want 0", st.Locks)
		}
		h.now = h.now.Add(idleKeep / 2)
		cycle(h, "L", 1)
		if h.m.locks["L"] != l {
			t.Fatal("a new state for a lock whose idle state was kept")
		}
		// The timer armed at the first release finds the state idle for less than
		// idleKeep and keeps it; the next firing drops it.
		h.fire(timer.Key{Kind: kindForget})
		if h.m.locks["L"] == nil {
			t.Fatal("dropped before idleKeep")
		}
		h.take()
		h.now = h.now.Add(idleKeep)
		h.fire(timer.Key{Kind: kindForget})
		if h.m.locks["L"] != nil || h.m.idleLocks != 0 {
			t.Fatalf("state kept idle past idleKeep (idle count %d)", h.m.idleLocks)
		}
		if s := h.take(); len(s.armed(kindForget)) != 0 {
			t.Errorf("forget timer re-armed with nothing idle: %v", s)
		}
	})

	t.Run("the other kind replaces an idle state", func(t *testing.T) {
		h := newMH(t)
		cycle(h, "L", 1)
		old := h.m.locks["L"]
		ctx := h.acquire("M", 9, 0, 0).ctx
		h.m.handle(acquireMsg{id: 99, lock: "L", owner: 3, fair: true, wait: 0, ctx: ctx, future: futures.New[error]()}, h.now)
		if l := h.m.locks["L"]; l == old || l.fair == nil {
			t.Fatal("a fair acquire reused an idle plain state")
		}
	})

	t.Run("a kind mismatch with a live state still fails", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		f := futures.New[error]()
		ctx := h.acquire("M", 9, 0, 0).ctx
		h.m.handle(acquireMsg{id: 99, lock: "L", owner: 2, fair: true, wait: 0, ctx: ctx, future: f}, h.now)
		if err := mustGet(t, "fair acquire of a live plain lock", f); !errors.Is(err, errKindMismatch) {
			t.Fatalf("got %v, want the kind mismatch", err)
		}
	})

	t.Run("at most maxIdleLocks kept", func(t *testing.T) {
		h := newMH(t)
		h.m.idleLocks = maxIdleLocks // as if that many were kept
		cycle(h, "L", 1)
		if h.m.locks["L"] != nil || h.m.idleLocks != maxIdleLocks {
			t.Fatalf("state kept past the cap (idle count %d)", h.m.idleLocks)
		}
	})
}
