package engine

// Orders of one owner's calls that Redis may run differently from how they were
// sent: each test is a message sequence a review found, which made the engine's
// hold count part from Redis's before its fix.

import (
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// handsOverEarlyAfter answers give-back gb; owner 1's Unlock u, which waited for
// it, then hands "L" over to other (owner 2's waiter), granting it early, and the
// handoff's reply confirms the swap.
func (h *mh) handsOverEarlyAfter(t *testing.T, gb scriptCall, other *tw, u *futures.Future[error]) {
	t.Helper()
	h.reply(gb, replyInt(0), nil)
	c := h.take().one(t, scripts.LockHandoff)
	mustGranted(t, "owner 2, early", other.future)
	h.reply(c, replyInt(2), nil)
	mustGranted(t, "unlock", u)
}

// An Unlock waiting in afterGiveBacks for give-back g1 must also wait for a
// give-back g2 started while it waited (a second walked-away grant of the same
// hold, taken back with the owner idle): g2's count is already gone from the hold
// when the Unlock reads it (its handoff decision, its bound), while Redis counts it
// until g2 runs.
func TestMachineOrderUnlockWaitsForGiveBackStartedWhileParked(t *testing.T) {
	h := newMH(t)
	ws := h.reenteredTimes(t, 2) // count 3: one received, two unreceived
	other := h.acquire("L", 2, 0, -1)
	h.take()
	h.cancelCtx(ws[1]) // owner idle: g1 goes at once
	g1 := h.take().one(t, scripts.LockReleaseOwner)
	u := h.unlock("L", 1) // waits for g1
	h.take().none(t)
	h.cancelCtx(ws[0]) // owner idle again (no serialized call): g2 starts now
	s := h.take()      // g2 goes at once, or (serialized give-backs) at g1's reply
	h.reply(g1, replyInt(0), nil)
	s.scripts = append(s.scripts, h.take().scripts...)
	g2 := s.calls(scripts.LockReleaseOwner)
	if want := []string{"0", "cid:1", "1", "1"}; len(g2) != 1 || !slices.Equal(g2[0].args, want) {
		t.Fatalf("g2 %v, want one with args %v", s, want)
	}
	if s.scripts = slices.DeleteFunc(s.scripts, func(c scriptCall) bool { return c.script == scripts.LockReleaseOwner }); len(s.scripts) != 0 {
		// Redis may run this before g2 (still in flight): count 2 there, so the
		// handoff answers 0 and owner 2, granted early, never holds the lock.
		if err, ok := peek(other.future); ok && err == nil {
			t.Fatalf("owner 2 granted early by %v while g2 (one count on Redis) is in flight", s)
		}
		t.Fatalf("unlock sent %v while g2 is in flight; want it to wait for g2", s)
	}
	mustPending(t, "unlock behind g2", u)
	h.handsOverEarlyAfter(t, g2[0], other, u)
}

// A TryLock parked behind give-back g1 must also wait for a whole-field
// release of the owner's started while it waited (its hold's expiry): sent before
// that release has run, the try can take the lock on the owner's field, which the
// release then deletes under it.
func TestMachineOrderTryLockWaitsForLostReleaseStartedWhileParked(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 5*time.Second)
	re := h.acquire("L", 1, 5*time.Second, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	hd := h.hold("L", 1)
	h.cancelCtx(re) // walked away, owner idle: g1 goes at once
	g1 := h.take().one(t, scripts.LockReleaseOwner)
	try := h.acquire("L", 1, 5*time.Second, 0) // a re-entry: waits for g1
	h.take().none(t)
	h.now = h.now.Add(5 * time.Second)
	h.fire(timer.Key{Kind: kindExpiry, ID: hd.id}) // the hold expires: its field goes, owner-guarded
	g2 := h.take().one(t, scripts.LockReleaseOwner)
	if g2.args[2] != "0" {
		t.Fatalf("g2 args %v, want a whole-field release", g2.args)
	}
	h.reply(g1, replyInt(-1), nil)
	if s := h.take(); len(s.calls(scripts.LockAcquire)) != 0 {
		// Redis may run it before g2: it takes the lock on cid:1, and g2 deletes it.
		t.Fatalf("try sent while the whole-field release g2 is in flight: %v", s)
	}
	mustPending(t, "try", try.future)
	h.reply(g2, replyInt(-1), nil)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	mustGranted(t, "try", try.future)
}

// A fair waiter's leave must not give back (claim "1") a hold that its
// handle's single try, in flight, may take: Redis may run the try first (it takes
// the free lock, the waiter's entry heading the queue), then the leave, which
// deletes that hold as an unheard direct grant, while the engine grants the try.
func TestMachineOrderFairLeaveDoesNotGiveBackTryInFlight(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // a queued in Redis
	h.take()
	try := h.tryFair("L", 1)
	call := h.take().one(t, scripts.FairAcquire)
	h.cancelCtx(a) // a gives up while the try is in flight
	for _, c := range h.take().calls(scripts.FairLeave) {
		if c.args[4] == "1" {
			t.Fatalf("leave %v sent with claim 1 while the owner's try is in flight", c.args)
		}
	}
	h.reply(call, replyNil, nil)
	mustGranted(t, "try", try)
	leave := h.take().one(t, scripts.FairLeave) // after the try's reply: it knows the hold
	if leave.args[4] != "0" {
		t.Fatalf("leave %v after the try took the lock, want claim 0", leave.args)
	}
}

// A handoff to a waiter whose handle has a single try in flight: the
// waiter walks away during the handoff, and the grant goes back at its reply
// (releaseOne without waiting, as if the handoff were the owner's only call). When
// its earlier attempt failed (maySurplus), that give-back deletes the whole field,
// and Redis may run it after the try re-entered the field the handoff put there:
// the try's Lock returned nil on a lock nobody holds.
func TestMachineOrderNoHandoffToOwnerWithCallInFlight(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 2, 0)
	w := h.acquire("L", 1, 0, -1) // queued behind owner 2's local hold
	h.take()
	h.notice("L")
	att := h.take().one(t, scripts.LockAcquire)
	h.reply(att, scripts.Reply{}, errConn) // ambiguous: it may have run
	h.take()
	try := h.acquire("L", 1, 0, 0) // the same handle's single try, in flight
	tc := h.take().one(t, scripts.LockAcquire)
	u := h.unlock("L", 2)
	s := h.take()
	if hs := s.calls(scripts.LockHandoff); len(hs) == 1 {
		h.cancelCtx(w) // walks away during the handoff
		h.take()
		h.reply(hs[0], replyInt(2), nil) // handed over: cid:1 = 1
		mustGranted(t, "owner 2's unlock", u)
		for _, c := range h.take().calls(scripts.LockReleaseOwner) {
			if c.args[1] == "cid:1" && c.args[2] == "0" {
				// Redis: handoff (cid:1=1), try (cid:1=2), this (cid:1 gone).
				h.reply(tc, replyNil, nil)
				mustGranted(t, "try", try.future)
				t.Fatalf("whole-field release %v sent while the owner's try is in flight; the try is granted on a lock it will not hold", c.args)
			}
		}
		t.Fatalf("handoff to owner 1 while its try is in flight: %v", hs[0].args)
	}
	_ = s.one(t, scripts.LockRelease)
	h.reply(tc, replyPTTL(30*time.Second), nil)
}

// Two one-count give-backs of one hold in flight at once. Each is bounded
// by the counts the owner keeps as of its send (2, then 1), which makes a retry of
// either idempotent but the pair order-dependent: if the second runs first (3 -> 2),
// or the first's try fails unrun and its retry goes after the second ran, the first
// finds 2 = its bound and drops nothing. Redis then counts 2 where the engine
// counts 1, and the owner's last Unlock hands over early on a lock it does not free.
func TestMachineOrderGiveBacksOfOneHoldAreSerialized(t *testing.T) {
	h := newMH(t)
	ws := h.reenteredTimes(t, 2) // count 3
	other := h.acquire("L", 2, 0, -1)
	h.take()
	h.cancelCtx(ws[1])
	g1 := h.take().one(t, scripts.LockReleaseOwner) // keep 2
	h.cancelCtx(ws[0])
	if s := h.take(); len(s.calls(scripts.LockReleaseOwner)) != 0 {
		// Redis: g2 (3 -> 2, keep 1), then g1 or its retry (2 <= keep 2: nothing).
		g2 := s.calls(scripts.LockReleaseOwner)[0]
		h.reply(g1, scripts.Reply{}, errConn)
		g1r := h.take().one(t, scripts.LockReleaseOwner)
		h.reply(g2, replyInt(0), nil)
		h.reply(g1r, replyInt(0), nil)
		u := h.unlock("L", 1)
		if c := h.take().calls(scripts.LockHandoff); len(c) == 1 && c[0].early {
			mustGranted(t, "owner 2, early", other.future)
			_ = u
			t.Fatalf("give-backs %v and %v in flight at once; the last Unlock then grants early on a count Redis still holds twice", g1.args, g2.args)
		}
		t.Fatalf("give-backs %v and %v in flight at once", g1.args, g2.args)
	}
	h.reply(g1, replyInt(0), nil)
	g2 := h.take().one(t, scripts.LockReleaseOwner)
	if want := []string{"0", "cid:1", "1", "1"}; !slices.Equal(g2.args, want) {
		t.Fatalf("second give-back args %v, want %v", g2.args, want)
	}
	u := h.unlock("L", 1) // waits for g2
	h.take().none(t)
	h.handsOverEarlyAfter(t, g2, other, u)
}

// The same handoff beside a single try, with no reordering at all: the try
// fails on a transport error, and its clean-up (undoAmbiguous: "the attempt is the
// owner's only call") deletes the owner's field whole while the handoff that puts
// that field on the server is in flight. Redis, in send order: the try (refused),
// the handoff (cid:1 = 1), the clean-up (cid:1 gone); the engine grants the waiter.
func TestMachineOrderTryFailureDoesNotUndoHandoffToSameHandle(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 2, 0)
	w := h.acquire("L", 1, 0, -1) // queued behind owner 2's local hold
	h.take()
	try := h.acquire("L", 1, 0, 0)
	tc := h.take().one(t, scripts.LockAcquire)
	h.unlock("L", 2)
	s := h.take()
	hs := s.calls(scripts.LockHandoff)
	h.reply(tc, scripts.Reply{}, errConn)
	if err := mustGet(t, "try", try.future); err == nil {
		t.Fatal("try granted")
	}
	cleanup := h.take().calls(scripts.LockReleaseOwner)
	if len(hs) == 1 && len(cleanup) == 1 && cleanup[0].args[1] == "cid:1" && cleanup[0].args[2] == "0" {
		h.reply(hs[0], replyInt(2), nil)
		mustGranted(t, "waiter", w.future)
		t.Fatalf("whole-field clean-up %v sent while the handoff to the same field was in flight: the waiter holds nothing on Redis", cleanup[0].args)
	}
	// Fixed: a plain release; the waiter attempts once it is answered (not stranded).
	rel := s.one(t, scripts.LockRelease)
	if len(cleanup) == 1 {
		h.reply(cleanup[0], replyInt(-1), nil) // the try's clean-up: its attempt waits for it
	}
	h.waiterTakesItAfter(t, rel, w)
}

// waiterTakesItAfter answers release rel as the lock's release; waiter w, refused
// the handoff, then attempts and takes "L".
func (h *mh) waiterTakesItAfter(t *testing.T, rel scriptCall, w *tw) {
	t.Helper()
	h.reply(rel, replyInt(1), nil)
	h.reply(h.attemptAfterRelease(t, "L"), replyNil, nil)
	mustGranted(t, "waiter", w.future)
}

// A waiter refused a handoff because its handle's single try was in flight
// attempts once the release and the try are answered (the try's reply first).
func TestMachineOrderRefusedHandoffWaiterAttempts(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 2, 0)
	w := h.acquire("L", 1, 0, -1)
	h.take()
	try := h.acquire("L", 1, 0, 0)
	tc := h.take().one(t, scripts.LockAcquire)
	h.unlock("L", 2)
	rel := h.take().one(t, scripts.LockRelease)
	h.reply(tc, replyPTTL(30*time.Second), nil) // try refused (ran before the release)
	if err := mustGet(t, "try", try.future); err == nil {
		t.Fatal("try granted")
	}
	h.take().none(t)
	h.waiterTakesItAfter(t, rel, w)
}

// The same on a fair lock, the release and its message first, the try's reply
// last.
func TestMachineOrderRefusedFairHandoffWaiterAttempts(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 2)
	h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
	h.take()
	mustGranted(t, "a", a.future)
	w := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	try := h.tryFair("L", 1)
	tc := h.take().one(t, scripts.FairAcquire)
	h.unlock("L", 2)
	rel := h.take().one(t, scripts.FairRelease)
	h.reply(rel, replyInt(1), nil)
	h.take()
	h.m.handle(unlockNotice{channel: channelName("L") + ":" + testClientID + ":1", payload: unlockMessage}, h.now)
	h.take().none(t)
	h.reply(tc, replyInt(1), nil) // try refused
	if err := mustGet(t, "try", try); err == nil {
		t.Fatal("try granted")
	}
	att := h.take().one(t, scripts.FairAcquire)
	h.reply(att, replyNil, nil)
	mustGranted(t, "waiter", w.future)
}

// A fair leave parked behind its handle's try, then Close: the leave goes at the
// try's reply, and the lock's state stays until it has.
func TestMachineOrderParkedLeaveAtClose(t *testing.T) {
	h := newMH(t)
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	h.subscribed("L")
	for _, c := range h.take().calls(scripts.FairAcquire) {
		h.reply(c, replyPTTL(30*time.Second), nil)
	}
	h.take()
	h.tryFair("L", 1)
	call := h.take().one(t, scripts.FairAcquire)
	h.cancelCtx(a)
	h.take().none(t)
	h.m.handle(closeMsg{}, h.now)
	s := h.take()
	if len(s.calls(scripts.FairLeave)) != 0 {
		t.Fatalf("leave sent at close: %v", s)
	}
	if !h.live("L") {
		t.Fatal("lock state gone")
	}
	h.reply(call, replyInt(1), nil)
	leave := h.take().one(t, scripts.FairLeave)
	if leave.args[4] != "1" {
		t.Fatalf("leave %v", leave.args)
	}
	h.reply(leave, replyInt(1), nil)
	h.take()
	if l := h.m.locks["L"]; l != nil && (l.inflight != 0 || l.cleanupsWaiting != 0) {
		t.Fatalf("lock state left: %+v", l)
	}
	if len(h.m.serial)+len(h.m.giveBacks)+len(h.m.boundedGiveBacks) != 0 {
		t.Fatalf("left: %v %v %v", h.m.serial, h.m.giveBacks, h.m.boundedGiveBacks)
	}
}

// An owner's bounded give-backs queued behind one in flight, then Close, the first
// failing (no retry while closing): the others still go, one bounded one at a
// time (Close's own release of the whole field goes beside them), and nothing of
// the owner's is left.
func TestMachineOrderBoundedGiveBacksAtClose(t *testing.T) {
	h := newMH(t)
	ws := h.reenteredTimes(t, 3)
	h.cancelCtx(ws[2])
	g1 := h.take().one(t, scripts.LockReleaseOwner)
	h.cancelCtx(ws[1])
	h.cancelCtx(ws[0])
	h.take().none(t) // both wait for g1
	h.m.handle(closeMsg{}, h.now)
	pending := h.take().calls(scripts.LockReleaseOwner)
	h.reply(g1, scripts.Reply{}, errConn)
	pending = append(pending, h.take().calls(scripts.LockReleaseOwner)...)
	bounded := 1 // g1
	for len(pending) > 0 {
		n := 0
		for _, c := range pending {
			if len(c.args) == 4 {
				n++
			}
		}
		if n > 1 {
			t.Fatalf("%d bounded give-backs of one owner in flight at once: %v", n, pending)
		}
		bounded += n
		var next []scriptCall
		for _, c := range pending {
			h.reply(c, replyInt(0), nil)
			next = append(next, h.take().calls(scripts.LockReleaseOwner)...)
		}
		pending = next
	}
	if bounded != 3 {
		t.Fatalf("%d bounded give-backs sent, want 3", bounded)
	}
	if l := h.m.locks["L"]; l != nil && !l.idle {
		t.Fatalf("lock state left: inflight %d cleanups waiting %d", l.inflight, l.cleanupsWaiting)
	}
	if len(h.m.serial)+len(h.m.giveBacks)+len(h.m.boundedGiveBacks) != 0 {
		t.Fatalf("left: %v %v %v", h.m.serial, h.m.giveBacks, h.m.boundedGiveBacks)
	}
}

// The receiver of an early fair handoff that did not hand over leaves the Redis
// queue in the handoff's reply itself (the call being answered is not one it
// waits for: machine.answering), before the relayed owners' leaves and anything
// their release starts.
func TestMachineOrderReceiverLeavesFirst(t *testing.T) {
	h, c, _, _ := fairRelaySetup(t)
	h.reply(c, replyNil, nil) // the releasing owner had lost the lock
	var fields []string
	for _, l := range h.take().calls(scripts.FairLeave) {
		fields = append(fields, l.args[0])
	}
	if len(fields) == 0 || fields[0] != "cid:3" {
		t.Fatalf("leaves %v, want the receiver's (cid:3) first", fields)
	}
}

// Reading a reply allocates nothing of its own (machine.answering is a copy of a
// few fields, not a pointer that would move every reply to the heap).
func TestMachineReplyAllocatesNothing(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	l := h.lock("L")
	d := scriptDone{call: scriptCall{script: scripts.LockRenew, purpose: purposeRenew, lock: l.id}, reply: replyInt(1)}
	n := testing.AllocsPerRun(1000, func() {
		l.inflight++
		h.m.onScriptDone(d, h.now)
		h.m.fx.reset()
	})
	if n != 0 {
		t.Fatalf("%v allocations per renewal reply, want 0", n)
	}
}
