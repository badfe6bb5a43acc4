package engine

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// One owner's calls run one at a time, so their replies cannot be handled in
// another order than Redis ran them: an Unlock in flight holds back the same
// handle's re-entry until its reply is in (and the other way round).
func TestMachineOwnerCallsAreSerialized(t *testing.T) {
	t.Run("re-entry waits for the unlock in flight", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		rel, unlocked := h.unlockCall(t, "L", 1, scripts.LockRelease)
		again := h.acquire("L", 1, 0, -1)
		h.take().none(t) // held back, not sent alongside the release
		h.reply(rel, replyInt(1), nil)
		mustGranted(t, "unlock", unlocked)
		// Now the handle holds nothing: its acquire is an ordinary queued attempt.
		att := h.take().one(t, scripts.LockAcquire)
		h.reply(att, replyNil, nil)
		mustGranted(t, "acquire after the unlock", again.future)
		if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
			t.Fatalf("hold %+v, want count 1", hd)
		}
	})
	t.Run("unlock waits for the re-entry in flight", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		again := h.acquire("L", 1, 0, -1)
		att := h.take().one(t, scripts.LockAcquire)
		unlocked := h.unlock("L", 1)
		h.take().none(t)
		h.reply(att, replyNil, nil)
		mustGranted(t, "re-entry", again.future)
		rel := h.take().one(t, scripts.LockRelease)
		h.reply(rel, replyInt(0), nil)
		mustGranted(t, "unlock", unlocked)
		if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
			t.Fatalf("hold %+v, want count 1", hd)
		}
	})
	t.Run("Close answers what waited", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		h.unlockCall(t, "L", 1, scripts.LockRelease)
		again := h.acquire("L", 1, 0, -1)
		h.m.handle(closeMsg{}, h.now)
		if err := mustGet(t, "held-back acquire", again.future); !errors.Is(err, ErrClosed) {
			t.Fatalf("got %v, want ErrClosed", err)
		}
	})
}

// A grant whose caller was cancelled while the attempt was in flight is given back;
// if that waiter was the last, the lock's subscription and timers go too.
func TestMachineCancelledGrantEmptiesQueue(t *testing.T) {
	h := newMH(t, func(c *config) { c.linger = 0 })
	w := h.heldElsewhere("L", 1, -1, 30*time.Second)
	h.notice("L")
	att := h.take().one(t, scripts.LockAcquire)
	h.cancelCtx(w)
	h.reply(att, replyNil, nil)
	s := h.take()
	s.one(t, scripts.LockReleaseOwner)
	if len(s.unsubscribes()) != 1 {
		t.Fatalf("no unsubscribe after the last waiter's grant was given back: %v", s)
	}
}

// A holder whose re-entry is refused has lost the lock: its Lost closes at once,
// not at the next renewal.
func TestMachineRefusedReentryLosesHold(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	lost := h.hold("L", 1).lostSignal().C()
	h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(20*time.Second), nil)
	mustFired(t, "Lost", lost)
	if h.hold("L", 1) != nil {
		t.Fatal("stale hold kept")
	}
}

// ForceUnlock does not take down a hold granted after it was sent (its own unlock
// message may have woken a local waiter that got the lock since).
func TestMachineForceSparesLaterGrant(t *testing.T) {
	h := newMH(t)
	f := newForce(h, "L")
	sentAt := h.now
	h.now = h.now.Add(time.Millisecond)
	h.grantFresh("L", 1, 0)
	lost := h.hold("L", 1).lostSignal().C()
	h.replyAt(f, sentAt, replyInt(1), nil)
	mustNotFired(t, "Lost of the later grant", lost)
	if h.hold("L", 1) == nil {
		t.Fatal("later grant dropped by the force-release")
	}
}

func newForce(h *mh, lock string) scriptCall {
	h.t.Helper()
	h.m.handle(forceUnlockMsg{lock: lock, future: newForceFuture()}, h.now)
	return h.take().one(h.t, scripts.LockForceRelease)
}

// A fair waiter whose attempt failed on a transport error keeps a way to retry:
// when the back-off ends, it is woken even if it is not the first local waiter.
func TestMachineFairWaiterRetriesAfterTransportError(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	b := h.acquireFair("L", 2)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	s := h.take()
	// b's own retry timer fires; its attempt fails on the connection.
	var bRetry *timerOp
	for _, op := range s.armed(kindFairRetry) {
		if op.key.ID == b.id {
			bRetry = &op
		}
	}
	if bRetry == nil {
		t.Fatalf("no retry timer armed for b: %v", s)
	}
	h.fire(bRetry.key)
	h.reply(h.take().one(t, scripts.FairAcquire), scripts.Reply{}, errConn)
	retry := h.take().retryArmed(t)
	h.fire(retry.key)
	// One attempt at a time per lock: the first woken local waiter may go first;
	// b must follow without any further timer or message.
	var owners []string
	for i := 0; i < 2; i++ {
		calls := h.take().calls(scripts.FairAcquire)
		if len(calls) != 1 {
			break
		}
		owners = append(owners, calls[0].args[1])
		if calls[0].args[1] == "cid:2" {
			break
		}
		h.reply(calls[0], replyPTTL(30*time.Second), nil)
	}
	if !slices.Contains(owners, "cid:2") {
		t.Fatalf("after the back-off, attempts by %v; b (cid:2) must retry", owners)
	}
	mustPending(t, "a", a.future)
}

// acquireFair is acquire on a fair lock, waiting until its context ends.
func (h *mh) acquireFair(lock string, owner uint64) *tw {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.t.Cleanup(cancel)
	h.nextID++
	w := &tw{id: h.nextID, lock: lock, owner: owner, ctx: ctx, cancel: cancel, future: futures.New[error]()}
	h.m.handle(acquireMsg{id: w.id, lock: lock, owner: owner, fair: true, wait: -1, ctx: ctx, future: w.future}, h.now)
	return w
}

// tryFair is a single try (wait 0) on a fair lock.
func (h *mh) tryFair(lock string, owner uint64) *futures.Future[error] {
	h.nextID++
	f := futures.New[error]()
	h.m.handle(acquireMsg{id: h.nextID, lock: lock, owner: owner, fair: true, ctx: context.Background(), future: f}, h.now)
	return f
}

// fairRetry returns the one fair-lock retry timer the step armed.
func (s step) fairRetry(t *testing.T) timerOp {
	t.Helper()
	armed := s.armed(kindFairRetry)
	if len(armed) != 1 {
		t.Fatalf("want one fair retry armed: %v", s)
	}
	return armed[0]
}

func newForceFuture() *futures.Future[forceResult] { return futures.New[forceResult]() }

// A fair waiter that queued behind another waiter of its handle re-enters once
// that one holds, as a serialized call: the owner's Unlock waits for its reply
// (else Redis could run the re-entry first and the engine take the Unlock's reply
// for a surplus count, and drop both).
func TestMachineFairSecondWaiterOfHandleReentersSerialized(t *testing.T) {
	h := newMH(t)
	h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // queued in Redis
	s := h.take()
	h.acquireFair("L", 1) // the same handle, from another goroutine: waits locally
	if calls := h.take().calls(scripts.FairAcquire); len(calls) != 0 {
		t.Fatalf("second waiter of the handle joined while the first is queued: %v", calls[0].args)
	}
	// The first waiter's retry finds the lock free and takes it.
	h.fire(s.fairRetry(t).key)
	h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
	reentry := h.take().one(t, scripts.FairAcquire)
	if !reentry.serial || reentry.args[6] != "0" {
		t.Fatalf("second waiter's call: serial %v, claim %q; want a serialized re-entry (claim 0)", reentry.serial, reentry.args[6])
	}
	f := h.unlock("L", 1)
	if calls := h.take().calls(scripts.FairRelease); len(calls) != 0 {
		t.Fatal("Unlock sent while the re-entry is in flight")
	}
	h.reply(reentry, replyNil, nil) // re-entered: count 2
	if calls := h.take().calls(scripts.FairRelease); len(calls) != 1 {
		t.Fatal("Unlock not sent after the re-entry's reply")
	}
	mustPending(t, "unlock", f)
	if hd := h.hold("L", 1); hd == nil || hd.count != 2 {
		t.Fatalf("hold %+v, want count 2", hd)
	}
}

// A fair waiter in the Redis queue whose handle's single try then took the lock
// (the try's call popped the handle's entry) re-enters as a serialized call too,
// at once, not on its next wake: a queued attempt could race the handle's Unlock.
func TestMachineFairQueuedWaiterReentersAfterHandlesTryLock(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // a queued in Redis
	h.take()
	try := h.tryFair("L", 1)
	call := h.take().one(t, scripts.FairAcquire)
	h.reply(call, replyNil, nil) // the lock was free and a's entry headed the queue: the try took it
	mustGranted(t, "single try", try)
	reentry := h.take().one(t, scripts.FairAcquire)
	if !reentry.serial || reentry.waiter != a.id || reentry.args[6] != "0" {
		t.Fatalf("a's call: serial %v, waiter %d, claim %q; want a's serialized re-entry", reentry.serial, reentry.waiter, reentry.args[6])
	}
	h.unlock("L", 1)
	if calls := h.take().calls(scripts.FairRelease); len(calls) != 0 {
		t.Fatal("Unlock sent while a's re-entry is in flight")
	}
	h.reply(reentry, replyNil, nil)
	mustGranted(t, "a", a.future)
	if calls := h.take().calls(scripts.FairRelease); len(calls) != 1 {
		t.Fatal("Unlock not sent after the re-entry's reply")
	}
}

// A fair waiter's queued attempt is one of its owner's serialized calls too: the
// handle's single try waits for it, and so does the handle's Unlock after, so no
// reply can be taken for another's.
func TestMachineFairTryLockWaitsForOwnersQueuedAttempt(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // a queued in Redis
	h.fire(h.take().fairRetry(t).key)
	attempt := h.take().one(t, scripts.FairAcquire) // a's retry, in flight
	if !attempt.serial {
		t.Fatal("a's queued attempt is not serialized with its owner's calls")
	}
	try := h.tryFair("L", 1)
	if calls := h.take().calls(scripts.FairAcquire); len(calls) != 0 {
		t.Fatalf("the handle's single try went out during its waiter's attempt: %v", calls[0].args)
	}
	h.reply(attempt, replyNil, nil) // a took the lock
	mustGranted(t, "a", a.future)
	reentry := h.take().one(t, scripts.FairAcquire) // now the try: a re-entry
	h.reply(reentry, replyNil, nil)
	mustGranted(t, "single try", try)
	if hd := h.hold("L", 1); hd == nil || hd.count != 2 {
		t.Fatalf("hold %+v, want count 2", hd)
	}
}

// A Mutex's queued attempt is one of its owner's serialized calls: a single try of
// the same handle waits for the attempt's reply (else Redis could run the two in
// either order while their replies came back in the other, and an Unlock's reply
// be read against the wrong count), and then re-enters.
func TestMachineQueuedAttemptSerializedWithTry(t *testing.T) {
	h := newMH(t)
	a := h.heldElsewhere("L", 1, -1, 30*time.Second) // a parked at the head
	h.notice("L")
	attempt := h.take().one(t, scripts.LockAcquire) // a's attempt, in flight
	try := h.acquire("L", 1, 0, 0)
	h.take().none(t)
	h.reply(attempt, replyNil, nil)
	mustGranted(t, "a", a.future)
	call := h.take().one(t, scripts.LockAcquire) // the try, now a re-entry
	h.reply(call, replyNil, nil)
	mustGranted(t, "single try", try.future)
	if hd := h.hold("L", 1); hd == nil || hd.count != 2 {
		t.Fatalf("hold %+v, want count 2", hd)
	}
}

// A fair leave whose retry fails too is sent again after a back-off until it runs:
// its waiter's entry, left in the Redis queue, would keep every process out once
// it heads the queue, for the whole wait allowance (found by a storm that kills
// connections: the queue's keys outlived it). Meanwhile the owner counts as
// leaving, and its give-back as in flight.
func TestMachineFairLeaveRetriedUntilItRuns(t *testing.T) {
	h := newMH(t)
	h.fairLeaveFailedTwice(t, "L", 1)
	settled := h.settle("L", 1)
	h.leaveResentAfterBackOffs(t, scripts.FairLeave, replyInt(2), func(int) {
		mustPending(t, "settle while the leave is pending", settled)
		if h.lock("L").leaving[1] == 0 {
			t.Fatal("the owner stopped counting as leaving before its leave ran")
		}
	}, nil)
	mustGranted(t, "settle after the leave ran", settled)
	if len(h.m.leaveRetries) != 0 || h.lock("L").leaving[1] != 0 {
		t.Fatalf("leave retries %v, leaving %v after the leave ran", h.m.leaveRetries, h.lock("L").leaving)
	}
}

// A caller of Acquire that took its context's end instead of the grant has
// returned; the grant is taken back when the engine hears of that end, which
// context.AfterFunc's goroutine may post after the handle's next calls. HoldCount
// (Settle) takes such grants back itself, so it does not count them (a shared
// handle's HoldCount read 3 with two goroutines, 1 run in 9).
func TestMachineSettleTakesBackWalkedAwayGrant(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	re := h.acquire("L", 1, 0, -1) // an Acquire's re-entry
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	if hd := h.hold("L", 1); hd.count != 2 {
		t.Fatalf("setup: count %d, want 2", hd.count)
	}
	re.cancel() // the caller walks away; its cancelMsg has not come yet
	settled := h.settle("L", 1)
	gb := h.take().one(t, scripts.LockReleaseOwner)
	if hd := h.hold("L", 1); hd.count != 1 {
		t.Fatalf("count %d after the take-back, want 1", hd.count)
	}
	mustPending(t, "settle behind the take-back", settled)
	h.reply(gb, replyInt(0), nil)
	mustGranted(t, "settle", settled)
	h.m.handle(cancelMsg{id: re.id, err: re.ctx.Err()}, h.now) // late: nothing left to take back
	h.take().none(t)
	if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
		t.Fatalf("hold %+v after the late cancel, want count 1", hd)
	}
}

// A hold that may have a surplus count on the server gives back its last count
// whole: a one-count release would leave the surplus holding the lock for nobody
// until its lease ran out.
func TestMachineTakeBackOfMaybeSurplusHoldReleasesAll(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, time.Second)
	re := h.acquire("L", 1, 0, -1) // an Acquire's re-entry
	att := h.take().one(t, scripts.LockAcquire)
	h.now = h.now.Add(2 * time.Second)
	h.fire(timer.Key{Kind: kindExpiry, ID: h.hold("L", 1).id}) // lost while the re-entry is in flight
	h.take()
	h.reply(att, replyNil, nil) // the re-entry took the field again: maybe counted twice
	h.take()
	if hd := h.hold("L", 1); hd == nil || !hd.maySurplus {
		t.Fatalf("setup: hold %+v, want maySurplus", hd)
	}
	h.cancelCtx(re) // walks away: the grant goes back
	gb := h.take().one(t, scripts.LockReleaseOwner)
	if gb.args[2] != "0" || len(gb.args) != 3 {
		t.Fatalf("give-back args %q, want the whole field (drop 0, no bound)", gb.args)
	}
}

// A fair leave sent again after a back-off carries the time of its sending: the
// deadlines fair_leave sets and purges by must not be as old as the outage.
func TestMachineFairLeaveRetryIsDatedAfresh(t *testing.T) {
	h := newMH(t)
	first := h.fairLeaveFailedTwice(t, "L", 1)
	op := h.take().armed(kindLeaveRetry)[0]
	h.now = h.now.Add(time.Minute)
	h.fire(op.key)
	again := h.take().one(t, scripts.FairLeave)
	if want := wallMillis(h.now); again.args[3] != want || first.args[3] == want {
		t.Fatalf("re-sent leave's now %s (first %s), want %s", again.args[3], first.args[3], want)
	}
}

// leaveResentAfterBackOffs checks that a leave (script id) whose send and one
// retry failed is sent again after a back-off, three times over: the first two of
// those sends fail too, and the third is answered ok. before, if set, runs before
// each send; check, if set, checks it.
func (h *mh) leaveResentAfterBackOffs(t *testing.T, id scripts.ID, ok scripts.Reply, before func(try int), check func(try int, c scriptCall)) {
	t.Helper()
	for try := range 3 {
		s := h.take()
		if len(s.scripts) != 0 {
			t.Fatalf("try %d: sent again at once, want after a back-off: %v", try, s)
		}
		armed := s.armed(kindLeaveRetry)
		if len(armed) != 1 || armed[0].d < minBackoff {
			t.Fatalf("try %d: want one leave retry armed after a back-off: %v", try, s)
		}
		if before != nil {
			before(try)
		}
		h.fire(armed[0].key)
		again := h.take().one(t, id)
		if check != nil {
			check(try, again)
		}
		if try < 2 {
			h.reply(again, scripts.Reply{}, errConn)
			continue
		}
		h.reply(again, ok, nil)
	}
}

// fairLeaveFailedTwice queues a fair waiter of owner in Redis, has it give up,
// and fails its leave and the leave's one retry with a transport error. It
// returns the first leave; the step after the retry's reply is not consumed.
func (h *mh) fairLeaveFailedTwice(t *testing.T, lock string, owner uint64) scriptCall {
	t.Helper()
	w := h.acquireFair(lock, owner)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // queued in Redis
	h.take()
	h.cancelCtx(w)
	first := h.take().one(t, scripts.FairLeave)
	h.reply(first, scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.FairLeave), scripts.Reply{}, errConn) // retryOnce's
	return first
}

// A give-back that waits for the owner's call in flight goes before the owner's
// requests that wait for that call too. The give-back's count is already gone from
// the hold, while Redis still counts it: an Unlock sent first would release on a
// count one too low (its bound and its handoff decision both read the hold), and
// Redis would answer "still held" to a release the engine took for the last one.
// Three goroutines share a handle: two hold, the third's re-entry was granted but
// it walked away while the first Unlock was in flight and the second waited.
func TestMachineGiveBackGoesBeforeWaitingUnlock(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	second := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	mustGranted(t, "second goroutine's re-entry", second.future)
	third := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	if hd := h.hold("L", 1); hd.count != 3 {
		t.Fatalf("setup: count %d, want 3", hd.count)
	}
	u1 := h.unlock("L", 1)
	rel1 := h.take().one(t, scripts.LockRelease)
	u2 := h.unlock("L", 1) // waits for u1's reply
	h.take().none(t)
	h.cancelCtx(third) // the third walked away: its grant goes back after u1's reply
	h.take().none(t)
	h.reply(rel1, replyInt(0), nil)
	mustGranted(t, "first unlock", u1)
	gb := h.take().one(t, scripts.LockReleaseOwner)
	if want := []string{"0", "cid:1", "1", "1"}; !slices.Equal(gb.args, want) {
		t.Fatalf("give-back args %v, want %v (one count, the one u2 holds kept)", gb.args, want)
	}
	mustPending(t, "second unlock behind the give-back", u2)
	h.releasesLastCountAfter(t, gb, u2)
}

// releasesLastCountAfter answers give-back gb; owner 1's Unlock u, which waited
// for it, then releases the last count of its hold on "L" (no bound), and the hold
// is gone.
func (h *mh) releasesLastCountAfter(t *testing.T, gb scriptCall, u *futures.Future[error]) {
	t.Helper()
	h.reply(gb, replyInt(0), nil)
	rel := h.take().one(t, scripts.LockRelease)
	if len(rel.args) != 6 {
		t.Fatalf("the unlock's args %v, want the last count's release (no bound)", rel.args)
	}
	h.reply(rel, replyInt(1), nil)
	mustGranted(t, "the last unlock", u)
	if hd := h.hold("L", 1); hd != nil {
		t.Fatalf("hold %+v after the last count's release", hd)
	}
}

// reenteredTimes makes owner 1 hold "L" by a fresh grant and n re-entries, each
// granted and left unreceived in its future (a caller that may still walk away).
func (h *mh) reenteredTimes(t *testing.T, n int) []*tw {
	t.Helper()
	h.grantFresh("L", 1, 0)
	var ws []*tw
	for range n {
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		ws = append(ws, w)
	}
	if hd := h.hold("L", 1); hd == nil || hd.count != n+1 {
		t.Fatalf("setup: hold %+v, want count %d", hd, n+1)
	}
	return ws
}

// A request that waited for give-backs and then waits for the owner's call in
// flight takes a fresh bound when it gets past that call: a give-back parked behind
// the call goes out first (parkCleanup), and the request waits for it too, not only
// for the give-backs it waited for before.
func TestMachineRequestWaitingAgainWaitsForParkedGiveBack(t *testing.T) {
	t.Run("unlock", func(t *testing.T) {
		h := newMH(t)
		ws := h.reenteredTimes(t, 3)
		h.cancelCtx(ws[2]) // walked away with the owner idle: its give-back goes at once
		g1 := h.take().one(t, scripts.LockReleaseOwner)
		u1 := h.unlock("L", 1) // both wait for g1
		u2 := h.unlock("L", 1)
		h.take().none(t)
		h.reply(g1, replyInt(0), nil)
		rel1 := h.take().one(t, scripts.LockRelease) // u1 goes; u2 waits for it
		h.cancelCtx(ws[1])                           // its give-back waits for u1 too
		h.take().none(t)
		h.reply(rel1, replyInt(0), nil)
		mustGranted(t, "first unlock", u1)
		g2 := h.take().one(t, scripts.LockReleaseOwner) // and nothing of u2's beside it
		mustPending(t, "second unlock behind the give-back", u2)
		h.releasesLastCountAfter(t, g2, u2)
	})
	t.Run("settle", func(t *testing.T) {
		h := newMH(t)
		ws := h.reenteredTimes(t, 3)
		h.cancelCtx(ws[2])
		g1 := h.take().one(t, scripts.LockReleaseOwner)
		u := h.unlock("L", 1) // both wait for g1
		s := h.settle("L", 1)
		h.take().none(t)
		ws[1].cancel() // walked away; its cancellation has not come: Settle takes it back
		h.reply(g1, replyInt(0), nil)
		rel := h.take().one(t, scripts.LockRelease) // u goes; the Settle waits for it
		mustPending(t, "settle", s)
		h.reply(rel, replyInt(0), nil)
		mustGranted(t, "unlock", u)
		g2 := h.take().one(t, scripts.LockReleaseOwner) // the Settle's take-back
		mustPending(t, "settle behind its take-back's give-back", s)
		h.reply(g2, replyInt(0), nil)
		h.take()
		mustGranted(t, "settle", s)
	})
}

// A one-count give-back that failed twice may not have run, so its hold is marked
// maySurplus before the Unlock that waited for it is handled: that Unlock then
// grants no local waiter early (the server may count one more than the engine,
// and its handoff would not hand over).
func TestMachineFailedGiveBackGrantsNobodyEarly(t *testing.T) {
	h := newMH(t)
	ws := h.reenteredTimes(t, 1)
	other := h.acquire("L", 2, 0, -1) // a local waiter of another owner
	h.take()
	h.cancelCtx(ws[0]) // the owner is idle: the give-back goes at once
	gb := h.take().one(t, scripts.LockReleaseOwner)
	u := h.unlock("L", 1) // waits for it
	h.take().none(t)
	h.reply(gb, scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.LockReleaseOwner), scripts.Reply{}, errConn)
	h.take()
	if err, ok := peek(other.future); ok {
		t.Fatalf("owner 2 answered (%v) after a give-back of unknown outcome; want no early grant", err)
	}
	mustPending(t, "unlock", u)
}
