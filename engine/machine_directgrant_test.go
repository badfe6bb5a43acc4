package engine

import (
	"fmt"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// Direct grants of the reentrant lock (directgrant.go), on the machine alone.

// withGrants is a machine whose grant channel is subscribed, so queued attempts
// register.
func withGrants(t *testing.T) *mh {
	h := newMH(t)
	h.m.grantSub = subSubscribed
	return h
}

// registeredWaiter queues a waiter of owner on lock, refused once and then
// registered by its second attempt (woken by an unlock message), which is refused
// too; it returns the waiter and that attempt.
func (h *mh) registeredWaiter(t *testing.T, lock string, owner uint64) (*tw, scriptCall) {
	t.Helper()
	w := h.acquire(lock, owner, 0, -1)
	first := h.take().one(t, scripts.LockAcquire)
	if len(first.args) != 2 || len(first.keys) != 1 {
		t.Fatalf("first attempt keys %q args %q, want no registration", first.keys, first.args)
	}
	h.reply(first, replyPTTL(30*time.Second), nil)
	h.take()
	h.notice(lock)
	att := h.take().one(t, scripts.LockAcquire)
	if len(att.args) != 5 || att.args[2] != "cid" || att.args[4] != h.m.grantFieldOf(w.id) {
		t.Fatalf("second attempt args %q, want a registration and the waiter's grant field", att.args)
	}
	return w, att
}

// grantMessage delivers the grant message of waiter w on lock, with stamp 0.
func (h *mh) grantMessage(w *tw) {
	h.m.handle(unlockNotice{channel: h.m.grantChannel, payload: fmt.Sprintf("%d|0|%s", w.id, w.lock)}, h.now)
}

var replyClaimed = scripts.Reply{Int: -3}

// heldByGrant makes owner hold lock by a direct grant taken from its message; the
// effects are consumed up to the grant, which made none.
func (h *mh) heldByGrant(t *testing.T, lock string, owner uint64) *tw {
	t.Helper()
	w, att := h.registeredWaiter(t, lock, owner)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.grantMessage(w)
	h.take().none(t)
	mustGranted(t, "grant by message", w.future)
	return w
}

// A registered waiter takes a grant from its message, under its grant field, with
// no call of its own; its handle's calls then use that field.
func TestMachineDirectGrantByMessage(t *testing.T) {
	h := withGrants(t)
	w := h.heldByGrant(t, "L", 1)
	if f := h.hold("L", 1).field; f != h.m.grantFieldOf(w.id) {
		t.Fatalf("hold field %q, want the grant's", f)
	}
	c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
	if c.args[2] != h.m.grantFieldOf(w.id) {
		t.Fatalf("release of field %q, want the grant's", c.args[2])
	}
}

// A grant claimed by the waiter's attempt before its message came: the message,
// arriving after the hold was handed on early, gives nothing back (the field is
// the handoff's to swap; a give-back racing it would delete the new holder's lock).
func TestMachineDirectGrantClaimedThenMessage(t *testing.T) {
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyClaimed, nil)
	mustGranted(t, "claimed grant", w.future)
	h.take()
	w2 := h.acquire("L", 2, 0, -1)
	h.take()
	c, _ := h.unlockCall(t, "L", 1, scripts.LockHandoff)
	if !c.early {
		t.Fatalf("the handoff to the local waiter did not grant early")
	}
	mustGranted(t, "early grant", w2.future)
	h.grantMessage(w)
	h.take().none(t)
}

// A grant to a waiter that left goes back by its grant field; a waiter that gives
// up leaves its registration (lock_leave), and the next waiter registers in its
// place in the same call.
func TestMachineDirectGrantLeave(t *testing.T) {
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	next := h.acquire("L", 2, 0, -1)
	h.take().none(t)
	h.cancelCtx(w)
	leave := h.take().one(t, scripts.LockLeave)
	if leave.args[1] != fmt.Sprint(w.id) || leave.args[2] != h.m.grantFieldOf(w.id) || leave.args[5] == "" {
		t.Fatalf("leave args %q, want w's id and field and the next waiter's registration", leave.args)
	}
	h.reply(leave, scripts.Reply{Int: 0}, nil)
	h.grantMessage(w) // a grant made before the leave ran
	back := h.take().one(t, scripts.LockLeave)
	if back.args[2] != h.m.grantFieldOf(w.id) {
		t.Fatalf("give-back of field %q, want w's grant field", back.args[2])
	}
	h.reply(back, scripts.Reply{Int: 1}, nil)
	h.grantMessage(next) // the next waiter, registered by the leave
	mustGranted(t, "grant to the waiter registered by the leave", next.future)
}

// A re-entry under a direct grant's field whose hold ends while the attempt is in
// flight, answered by a transport error: the field may hold the lock for nobody,
// so it is released before the waiter retries under its handle's field.
func TestMachineDirectGrantReentryFieldCleanedUp(t *testing.T) {
	h := withGrants(t)
	w := h.heldByGrant(t, "L", 1)
	field := h.m.grantFieldOf(w.id)
	h.acquire("L", 1, 0, -1) // a re-entry
	re := h.take().one(t, scripts.LockAcquire)
	if re.args[1] != field {
		t.Fatalf("re-entry names %q, want the grant's field %q", re.args[1], field)
	}
	h.m.loseHold(h.hold("L", 1), false)
	h.take()
	h.reply(re, scripts.Reply{}, errConn)
	c := h.take().one(t, scripts.LockReleaseOwner)
	if c.args[1] != field || c.args[2] != "0" {
		t.Fatalf("cleanup args %q, want all of the grant's field %q", c.args, field)
	}
}

// A subscription that was not confirmed leaves the lock unsubscribed, with a retry
// soon: a release that finds nobody listening publishes nothing.
func TestMachineSubscribeErrorRetries(t *testing.T) {
	h := withGrants(t)
	h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.m.handle(subscribeDone{lock: h.lockID("L"), err: errConn}, h.now)
	if l := h.lock("L"); l.sub != subNone {
		t.Fatalf("subscription state %v after an error, want none", l.sub)
	}
	if armed := h.take().armed(kindRetry); len(armed) != 1 || armed[0].d != subscribeRetry {
		t.Fatalf("retry timers %+v, want one in %v", armed, subscribeRetry)
	}
}
