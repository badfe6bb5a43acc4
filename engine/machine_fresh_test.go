package engine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// The fresh mark (scriptCall.fresh) lets the lone lane take a lock it expects to
// be free with one plain command (scripts.FreshRunner); a lock that is not free
// then costs a refused command before the script, so only attempts on locks that
// look free carry it.

func TestMachineFreshMarksFirstAttemptsOnFreeLocks(t *testing.T) {
	h := newMH(t)
	wantFresh := func(what string, call scriptCall, want bool) {
		t.Helper()
		if call.fresh != want {
			t.Errorf("%s: fresh = %v, want %v", what, call.fresh, want)
		}
	}

	// A first attempt on a lock nobody here holds is fresh.
	w := h.acquire("L", 7, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	wantFresh("first attempt", att, true)
	h.reply(att, replyNil, nil)
	h.take()
	mustGranted(t, "first attempt", w.future)

	// A re-entry finds the key held: not fresh.
	h.acquire("L", 7, 0, -1)
	att = h.take().one(t, scripts.LockAcquire)
	wantFresh("re-entry", att, false)
	h.reply(att, replyNil, nil)
	h.take()

	// Once the lock is free here again, a new owner's first attempt is fresh.
	for _, reply := range []int64{0, 1} { // one count less, then released
		call, f := h.unlockCall(t, "L", 7, scripts.LockRelease)
		h.reply(call, replyInt(reply), nil)
		mustGranted(t, "unlock", f)
	}
	h.take()
	w = h.acquire("L", 8, 0, -1)
	att = h.take().one(t, scripts.LockAcquire)
	wantFresh("first attempt after the release", att, true)

	// Refused (held by another process): the waiter's next attempt, on the
	// unlock message, is not fresh, and whether it carries a registration or not,
	// nor is a first attempt of another owner made while the last reply here
	// was a refusal.
	h.reply(att, replyPTTL(time.Second), nil)
	h.take()
	h.notice("L")
	att = h.take().one(t, scripts.LockAcquire)
	wantFresh("attempt after a refusal", att, false)
	h.reply(att, replyPTTL(time.Second), nil)
	h.take()
	w.cancel()
	h.take()
	h.acquire("L", 9, 0, -1)
	h.notice("L")
	att = h.take().one(t, scripts.LockAcquire)
	wantFresh("another owner's first attempt after a refusal", att, false)

	// Once an attempt here takes the lock, first attempts are fresh again.
	h.reply(att, replyNil, nil)
	h.take()
	call, f := h.unlockCall(t, "L", 9, scripts.LockRelease)
	h.reply(call, replyInt(1), nil)
	mustGranted(t, "unlock", f)
	h.acquire("L", 10, 0, -1)
	wantFresh("first attempt after a grant", h.take().one(t, scripts.LockAcquire), true)
}

// A batch's RESTORE refused for a fresh attempt (scripts.ErrFreshRefused:
// nothing ran) sends the same attempt again at once as the script, not fresh;
// its waiter keeps waiting for that reply, and the lock's next first attempts are
// not fresh either. A waiter that no longer waits is answered instead.
func TestMachineFreshRefusedInBatchResendsTheScript(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 7, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	if !att.fresh {
		t.Fatal("the first attempt is not fresh")
	}
	h.reply(att, scripts.Reply{}, scripts.ErrFreshRefused)
	again := h.take().one(t, scripts.LockAcquire)
	if again.fresh || again.waiter != att.waiter || again.owner != att.owner {
		t.Fatalf("resent attempt %+v, want the same waiter's, not fresh", again)
	}
	mustPending(t, "waiter while its script is in flight", w.future)
	if !h.lock("L").refusedLast {
		t.Error("the lock does not count as refused here")
	}
	h.reply(again, replyNil, nil)
	h.take()
	mustGranted(t, "the script's grant", w.future)

	// Refused while its waiter has been cancelled: nothing ran and nothing is
	// sent; the waiter gets its context's error.
	call, f := h.unlockCall(t, "L", 7, scripts.LockRelease)
	h.reply(call, replyInt(2), nil)
	mustGranted(t, "unlock", f)
	h.take()
	h.lock("L").refusedLast = false // as after a grant elsewhere: fresh again
	w = h.acquire("L", 8, 0, -1)
	att = h.take().one(t, scripts.LockAcquire)
	if !att.fresh {
		t.Fatal("the attempt after the release is not fresh")
	}
	h.cancelCtx(w)
	h.take()
	h.reply(att, scripts.Reply{}, scripts.ErrFreshRefused)
	if st := h.take(); len(st.scripts) != 0 {
		t.Fatalf("calls after a cancelled waiter's refused RESTORE: %v", st)
	}
	if err := mustGet(t, "cancelled waiter", w.future); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled waiter got %v, want context.Canceled", err)
	}
}
