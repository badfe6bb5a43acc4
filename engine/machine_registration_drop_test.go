package engine

import (
	"slices"
	"testing"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
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
	h.reply(h.take().one(t, scripts.LockReleaseOwner), replyInt(-1), nil)
	var leave *scriptCall
	for i := range 2 {
		if i == 1 {
			h.m.handle(unsubscribeDone{lock: h.lockID("L")}, h.now)
		}
		for _, c := range h.take().scripts {
			if c.script == scripts.LockLeave {
				leave = &c
			}
		}
		if leave != nil {
			break
		}
	}
	if leave == nil {
		t.Fatal("no lock_leave after the failed release: the registration may stay until it expires")
	}
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
