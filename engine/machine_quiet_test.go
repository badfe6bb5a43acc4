package engine

import (
	"testing"
	"time"

	"github.com/redis/rueidis"

	"github.com/leash-go/leash/internal/scripts"
)

// The quiet mark (scriptCall.quiet) lets the lone lane release a last count
// with HDEL and PUBLISH (scripts.QuietReleaser), which grant no registered
// waiter of another client directly: only releases of a lock on which nobody
// listened at its last release, and nobody was refused since, carry it.

func TestMachineQuietMarksReleasesOfUncontendedLocks(t *testing.T) {
	h := newMH(t)
	lock := func(owner uint64) {
		t.Helper()
		w := h.acquire("L", owner, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		mustGranted(t, "lock", w.future)
	}
	release := func(what string, owner uint64, quiet bool, reply scripts.Reply, err error) {
		t.Helper()
		call, f := h.unlockCall(t, "L", owner, scripts.LockRelease)
		if call.quiet != quiet {
			t.Errorf("%s: quiet = %v, want %v", what, call.quiet, quiet)
		}
		h.reply(call, reply, err)
		if err == nil && !reply.Nil {
			mustGranted(t, what, f)
		}
	}

	// Nothing is known of the lock's listeners before its first release here.
	lock(7)
	release("first release", 7, false, replyInt(2), nil)
	// It found nobody listening: the next one is quiet, and while each finds
	// nobody, the one after too.
	lock(7)
	release("release after a release nobody heard", 7, true, replyInt(2), nil)
	lock(7)
	release("and the next", 7, true, replyInt(1), nil)
	// Somebody heard that one: the script again, until one finds nobody.
	lock(7)
	release("release after a release somebody heard", 7, false, replyInt(2), nil)

	// A re-entered hold's first Unlock keeps a count: never quiet. Its last is.
	lock(7)
	lock(7)
	release("release keeping a count", 7, false, replyInt(0), nil)
	release("last count's release", 7, true, replyInt(2), nil)

	// A release that found the hold gone ends it too.
	lock(7)
	release("release before a lost hold's", 7, true, replyNil, nil)
	lock(7)
	release("release after a lost hold's", 7, false, replyInt(2), nil)

	// A waiter here: the release hands the lock over, or is the script's.
	lock(7)
	release("release before the waiter's", 7, true, replyInt(2), nil)
	lock(7)
	h.acquire("L", 10, 0, -1)
	h.take()
	h.unlock("L", 7)
	handoff := h.take().one(t, scripts.LockHandoff)
	if handoff.quiet {
		t.Error("the handoff carries the quiet mark")
	}
	h.reply(handoff, replyInt(2), nil)
	h.take()
	// The waiter subscribed to the lock's channel, and this client listens
	// while the subscription lasts: the script, which knows whether anybody
	// else does.
	release("the waiter's release", 10, false, replyInt(2), nil)

	// A refused attempt (another process holds the lock, and may have waiters
	// that registered) ends it. (The refused waiter's subscription would keep
	// the next release from being quiet anyway while it lasts.)
	if !h.m.locks["L"].quietLast {
		t.Fatal("the lock is not quiet before the refusal")
	}
	w := h.acquire("L", 8, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(time.Second), nil)
	h.take()
	if h.m.locks["L"].quietLast {
		t.Error("the lock is still quiet after a refused attempt")
	}
	w.cancel()
	h.take()
}

// TestMachineQuietEndsAtAFailedRelease: a release that failed (a Redis error:
// it is not retried) sends the next release of the lock to the script.
func TestMachineQuietEndsAtAFailedRelease(t *testing.T) {
	h := newMH(t)
	cycle := func(what string, owner uint64, quiet bool, reply scripts.Reply, err error) {
		t.Helper()
		w := h.acquire("L", owner, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		mustGranted(t, what, w.future)
		call, _ := h.unlockCall(t, "L", owner, scripts.LockRelease)
		if call.quiet != quiet {
			t.Errorf("%s: quiet = %v, want %v", what, call.quiet, quiet)
		}
		h.reply(call, reply, err)
		for _, c := range h.take().scripts { // the lost hold's owner-guarded release
			h.reply(c, replyInt(0), nil)
		}
		h.take()
	}
	cycle("first release", 7, false, replyInt(2), nil)
	cycle("quiet release that fails", 7, true, scripts.Reply{}, new(rueidis.RedisError))
	cycle("release after the failure", 8, false, replyInt(2), nil)
	cycle("and after that one", 8, true, replyInt(2), nil)
}

// TestMachineQuietFairReleases: a fair lock's last-count release is quiet, and
// the first attempt after it fresh, once its last release found nobody queued
// (fair_release's reply 2); neither after a release that passed the lock on (1)
// or an attempt that was refused.
func TestMachineQuietFairReleases(t *testing.T) {
	h := newMH(t)
	cycle := func(what string, quiet bool, reply scripts.Reply) {
		t.Helper()
		w := h.acquireFair("L", 7)
		att := h.take().one(t, scripts.FairAcquire)
		if att.fresh != quiet {
			t.Errorf("%s: the attempt's fresh = %v, want %v", what, att.fresh, quiet)
		}
		h.reply(att, replyNil, nil)
		h.take()
		mustGranted(t, what, w.future)
		call, f := h.unlockCall(t, "L", 7, scripts.FairRelease)
		if call.quiet != quiet {
			t.Errorf("%s: quiet = %v, want %v", what, call.quiet, quiet)
		}
		h.reply(call, reply, nil)
		h.take()
		mustGranted(t, what, f)
	}
	cycle("first cycle", false, replyInt(2))
	cycle("cycle after a release that found nobody queued", true, replyInt(2))
	cycle("and the next", true, replyInt(1))
	cycle("cycle after a release that passed the lock on", false, replyInt(2))
	cycle("and after one that found nobody again", true, replyInt(2))

	// A refused attempt: somebody else holds the lock, and others may queue.
	w := h.acquireFair("L", 8)
	att := h.take().one(t, scripts.FairAcquire)
	if !att.fresh {
		t.Error("the attempt before the refusal is not fresh")
	}
	h.reply(att, replyPTTL(time.Second), nil)
	h.take()
	if h.m.locks["L"].quietLast {
		t.Error("the fair lock is still quiet after a refused attempt")
	}
	w.cancel()
	h.take()
}

// TestMachineFreshFairFailureThenCancelLeaves: a fair waiter's fresh first
// attempt fails in transit (its last step, fair_acquire, may have queued the
// owner in Redis), and the waiter gives up during the back-off, after the
// give-back of what the RESTORE may have made: its queue entry must leave
// (fair_leave), as after a failed script attempt.
func TestMachineFreshFairFailureThenCancelLeaves(t *testing.T) {
	for _, fresh := range []bool{false, true} {
		h := newMH(t)
		if fresh { // a cycle whose release found nobody queued
			w := h.acquireFair("L", 7)
			h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
			h.take()
			mustGranted(t, "lock", w.future)
			call, _ := h.unlockCall(t, "L", 7, scripts.FairRelease)
			h.reply(call, replyInt(2), nil)
			h.take()
		}
		w := h.acquireFair("L", 8)
		att := h.take().one(t, scripts.FairAcquire)
		if att.fresh != fresh {
			t.Fatalf("fresh = %v, want %v", att.fresh, fresh)
		}
		h.reply(att, scripts.Reply{}, errConn)
		giveBacks := h.take().scripts
		if fresh && (len(giveBacks) != 1 || giveBacks[0].script != scripts.LockReleaseOwner) {
			t.Fatalf("after the fresh attempt's failure: %v, want one lock_release_owner", giveBacks)
		}
		for _, c := range giveBacks {
			h.reply(c, replyInt(-1), nil) // the owner held nothing
		}
		h.take()
		h.cancelCtx(w)
		leaves := 0
		for _, c := range h.take().scripts {
			if c.script == scripts.FairLeave {
				leaves++
			}
		}
		if leaves != 1 {
			t.Errorf("fresh=%v: the waiter that gave up sent %d fair_leave, want 1", fresh, leaves)
		}
	}
}
