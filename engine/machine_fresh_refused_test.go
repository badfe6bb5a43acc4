package engine

import (
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// TestMachineFreshRefusalOutlivesLockState: a TryLock refused (held by another
// process) leaves the lock state idle, and once idleKeep has passed the state is
// forgotten; the refusal is remembered apart from it, so the next TryLock on the
// same lock is not marked fresh (a periodic TryLock on a lock held elsewhere
// would otherwise pay a refused RESTORE before the script on every try).
func TestMachineFreshRefusalOutlivesLockState(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 7, 0, 0) // TryLock
	att := h.take().one(t, scripts.LockAcquire)
	h.reply(att, replyPTTL(time.Minute), nil)
	h.take()
	mustGet(t, "refused TryLock", w.future)

	// Immediately after, the refusal is remembered.
	w = h.acquire("L", 7, 0, 0)
	att = h.take().one(t, scripts.LockAcquire)
	if att.fresh {
		t.Fatalf("TryLock right after a refusal: fresh")
	}
	h.reply(att, replyPTTL(time.Minute), nil)
	h.take()
	mustGet(t, "refused TryLock", w.future)

	// Some seconds later (a periodic TryLock): the state was forgotten.
	h.now = h.now.Add(3 * time.Second)
	h.fire(timer.Key{Kind: kindForget})
	h.take()
	h.acquire("L", 7, 0, 0)
	att = h.take().one(t, scripts.LockAcquire)
	if att.fresh {
		t.Errorf("TryLock 3 s after a refusal (lock state forgotten): fresh = true, want false (the last attempt here was refused)")
	}
}
