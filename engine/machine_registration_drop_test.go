package engine

import (
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// A registration of this client's for direct grants is dropped by the release
// of its last local waiter's hold (lock_release's dereg argument). When that
// release fails in transit, whether it dropped the registration is unknown; once
// nothing here uses the lock any more, a lock_leave naming no waiter drops it,
// so no release elsewhere keeps granting to a waiter that is gone (which this
// client would give back, each time, until the registration expired).

// releaseOfRegistered makes owner 1 hold "L" after registering for direct grants,
// then unlocks it, and returns the release call and the Unlock's future.
func releaseOfRegistered(t *testing.T) (*mh, scriptCall, *futures.Future[error]) {
	t.Helper()
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyNil, nil)
	h.take()
	mustGranted(t, "registered waiter", w.future)
	call, f := h.unlockCall(t, "L", 1, scripts.LockRelease)
	return h, call, f
}

func TestMachineRegistrationDroppedAfterFailedRelease(t *testing.T) {
	h, call, f := releaseOfRegistered(t)
	if len(call.args) < 6 || call.args[5] != "1" {
		t.Fatalf("release args %q, want the registration dropped (ARGV[6] = 1)", call.args)
	}
	h.reply(call, scripts.Reply{}, errConn)
	retry := h.take().one(t, scripts.LockRelease)
	h.reply(retry, scripts.Reply{}, errConn)
	mustGet(t, "unlock", f)

	// The lost hold's owner-guarded release and the lock's unsubscription (a
	// registered client leaves the channel at once), then the registration's
	// leave once nothing else is in flight.
	leaves := h.collectLeaves(t, "L")
	if len(leaves) != 1 {
		t.Fatalf("%d lock_leaves after the failed release, want 1: the registration may stay until it expires", len(leaves))
	}
	leave := &leaves[0]
	if want := []string{"cid", "*", ""}; !slices.Equal(leave.args[:3], want) {
		t.Errorf("lock_leave args %q, want %q first (this client, any waiter, no grant field)", leave.args, want)
	}
	if h.live("L") == false {
		t.Error("lock state gone while its leave is in flight")
	}
	h.reply(*leave, replyInt(0), nil)
	h.take()
	if h.live("L") {
		t.Error("lock state still in use after the leave ran")
	}
}

// An ordinary release of the last waiter's hold drops the registration itself:
// no leave follows.
func TestMachineRegistrationDroppedByRelease(t *testing.T) {
	h, call, f := releaseOfRegistered(t)
	h.reply(call, replyInt(1), nil)
	mustGranted(t, "unlock", f)
	if s := h.take(); len(s.scripts) != 0 {
		t.Errorf("calls after a release that dropped the registration: %v", s)
	}
}

// collectLeaves drives lock through its unsubscription and returns the
// lock_leave calls made on the way, answering owner-guarded releases.
func (h *mh) collectLeaves(t *testing.T, lock string) []scriptCall {
	t.Helper()
	var leaves []scriptCall
	for i := range 3 {
		if i == 1 {
			if l := h.m.locks[lock]; l != nil && l.sub == subUnsubscribing {
				h.m.handle(unsubscribeDone{lock: l.id}, h.now)
			}
		}
		for _, c := range h.take().scripts {
			switch c.script {
			case scripts.LockLeave:
				leaves = append(leaves, c)
			case scripts.LockReleaseOwner:
				h.reply(c, replyInt(-1), nil)
			}
		}
	}
	return leaves
}

// The last local registered waiter gives up: its own leave drops whatever
// registration is this client's ("*"), and no second leave follows.
func TestMachineLastRegisteredWaiterLeavesOnce(t *testing.T) {
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.cancelCtx(w)
	leave := h.take().one(t, scripts.LockLeave)
	if leave.args[1] != "*" || leave.args[2] != h.m.grantFieldOf(w.id) {
		t.Errorf("leave args %q, want any waiter's registration (*) and the waiter's grant field", leave.args)
	}
	h.reply(leave, replyInt(0), nil)
	if more := h.collectLeaves(t, "L"); len(more) != 0 {
		t.Fatalf("waiter's own leave %q, then %d more: %q", leave.args, len(more), more[0].args)
	}
}

// A "*" leave put off after transport errors is not sent once a new local
// waiter has come (and may have registered): it would delete that registration.
// The registration then goes with the new waiter's last release or leave.
func TestMachineStaleStarLeaveNotResent(t *testing.T) {
	h, leaves := starLeaveOfFailedRelease(t)
	h.reply(leaves[0], scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.LockLeave), scripts.Reply{}, errConn) // its one quick retry
	s := h.take()
	ops := s.armed(kindLeaveRetry)
	if len(ops) != 1 {
		t.Fatalf("want a leave retry armed: %v", s)
	}
	w2, att2 := h.registeredWaiter(t, "L", 2)
	h.reply(att2, replyPTTL(30*time.Second), nil)
	h.take()
	mustPending(t, "new waiter", w2.future)
	h.fire(timer.Key{Kind: kindLeaveRetry, ID: ops[0].key.ID})
	for _, c := range h.take().scripts {
		if c.script == scripts.LockLeave && c.args[1] == "*" {
			t.Fatalf("stale '*' leave %q sent while waiter %d is registered", c.args, w2.id)
		}
	}
	if l := h.m.locks["L"]; l == nil || !l.mayBeRegistered {
		t.Error("the registration is not marked to go with the new waiter's release")
	}
}

// A release carrying the registration drop (ARGV[6] "1") whose first try fails in
// transit is sent again (retryOnce). Meanwhile a new local waiter may have
// registered (woken by its subscription, refused, registered by its next
// attempt): the retry goes without the drop, which lock_release would run first,
// whatever it finds, deleting the live waiter's registration.
func TestMachineRetriedReleaseKeepsNewWaitersRegistration(t *testing.T) {
	h, call, f := releaseOfRegistered(t)
	if call.args[5] != "1" {
		t.Fatalf("setup: release args %q, want the drop", call.args)
	}
	l := h.lock("L")
	// A new waiter of another owner comes while the release is in flight.
	w2 := h.acquire("L", 2, 0, -1)
	h.take()
	if l.sub == subUnsubscribing {
		h.m.handle(unsubscribeDone{lock: l.id}, h.now)
		h.take()
	}
	// Its subscription wakes the head (the first try may have run, its unlock
	// message unheard); that first attempt is refused (another client took the
	// lock).
	h.subscribed("L")
	att := h.take().one(t, scripts.LockAcquire)
	if len(att.args) != 2 {
		t.Fatalf("setup: first attempt args %q", att.args)
	}
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	// That client releases: the next attempt registers, and is refused.
	h.notice("L")
	s := h.take()
	att2 := s.one(t, scripts.LockAcquire)
	if len(att2.args) != 5 {
		t.Fatalf("setup: second attempt args %q, want a registration", att2.args)
	}
	h.reply(att2, replyPTTL(30*time.Second), nil)
	h.take()
	mustPending(t, "registered waiter", w2.future)
	if !h.m.waiters[w2.id].registered {
		t.Fatal("setup: waiter not registered")
	}
	// Now the first try of the release fails in transit; it is sent again.
	h.reply(call, scripts.Reply{}, errConn)
	retry := h.take().one(t, scripts.LockRelease)
	if len(retry.args) > 5 && retry.args[5] == "1" {
		t.Errorf("release retried with the registration drop (args %q) while waiter %d is queued and registered: "+
			"lock_release drops its registration first, whatever it finds", retry.args, w2.id)
	}
	h.reply(retry, scripts.Reply{Nil: true}, nil)
	mustGet(t, "unlock", f)
	h.take()
	if !l.mayBeRegistered {
		t.Error("the registration is not marked to go with the new waiter's release")
	}
}

// The same for a "*" leave's quick retry (retryOnce sends every lock_leave once
// more straight after its first transport error), as for its later ones
// (TestMachineStaleStarLeaveNotResent).
func TestMachineStarLeaveQuickRetryKeepsNewRegistration(t *testing.T) {
	h, leaves := starLeaveOfFailedRelease(t)
	// While the drop is in flight a new waiter comes and registers.
	w2, att2 := h.registeredWaiter(t, "L", 2)
	h.reply(att2, replyPTTL(30*time.Second), nil)
	h.take()
	mustPending(t, "new waiter", w2.future)
	// The drop's first try fails in transit: retryOnce sends it again at once.
	h.reply(leaves[0], scripts.Reply{}, errConn)
	for _, c := range h.take().scripts {
		if c.script == scripts.LockLeave && c.args[1] == "*" {
			t.Errorf("'*' leave %q sent again while waiter %d is queued and registered", c.args, w2.id)
		}
	}
}

// starLeaveOfFailedRelease: the release of the last registered waiter's hold fails
// twice, so the registration goes by a "*" leave, which it returns (one call).
func starLeaveOfFailedRelease(t *testing.T) (*mh, []scriptCall) {
	t.Helper()
	h, call, f := releaseOfRegistered(t)
	h.reply(call, scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.LockRelease), scripts.Reply{}, errConn)
	mustGet(t, "unlock", f)
	leaves := h.collectLeaves(t, "L")
	if len(leaves) != 1 || leaves[0].args[1] != "*" {
		t.Fatalf("leaves %v, want one '*'", leaves)
	}
	return h, leaves
}
