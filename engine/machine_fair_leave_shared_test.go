package engine

import (
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// A fair waiter a (owner 1) whose join failed on the connection (so it may have
// run: owner 1's entry, registered for a direct grant, may be in the Redis queue)
// gives up while its handle's TryLock (another goroutine's) is in flight. Its
// cleanup must still take owner 1's entry out of the Redis queue, if only after
// the try's reply: left there, once it heads the queue a release grants it (or
// wakes it) and every process waits out its lease (or FairWait) for nobody.
func TestMachineFairAmbiguousJoinLeavesBesideHandlesTry(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	a := h.acquireFair("L", 1)
	join := h.take().one(t, scripts.FairAcquire)
	h.reply(join, scripts.Reply{}, errConn) // may have queued cid:1
	h.take()

	h.tryFair("L", 1)
	try := h.take().one(t, scripts.FairAcquire)
	if try.args[4] != "1" {
		t.Fatalf("setup: %v is not a single try", try.args)
	}
	h.cancelCtx(a)
	var leaves []string
	collect := func() {
		for _, c := range h.take().calls(scripts.FairLeave) {
			leaves = append(leaves, c.args[0])
		}
	}
	collect()
	h.reply(try, replyInt(1), nil) // another process holds: the try is refused
	collect()
	if err := mustGet(t, "a", a.future); err == nil {
		t.Fatal("a granted after its context ended")
	}
	if !slices.Contains(leaves, "cid:1") {
		t.Fatalf("no fair_leave of cid:1 (leaves %v): the entry a's join may have queued stays in the Redis queue", leaves)
	}
}

// Two local waiters of one handle can stand in the Redis queue under its one
// entry: a behind an unqueued local head z joins with z (ownerQueued sees no
// leading run), and finds the entry of a, queued before. When b, the later of
// them, gives up, its leave must not take that shared entry out, nor give back a
// direct grant made to it: a still waits on it, and the grant's message (naming
// a's registration) would grant a with no field of owner 1's on the server.
//
//  1. Another process holds L. z (owner 9) and a (owner 1) queue in Redis.
//  2. Owner 9's TryLock claims a direct grant to z, its caller gone: the grant
//     goes back, owner 9 leaves; z is the local head, out of the Redis queue.
//  3. b (owner 1 again) arrives; once owner 9's give-back is answered, z and b
//     join together: b finds owner 1's entry (a's) and is queued too.
//  4. A release grants cid:1 directly (a's registration), and b gives up.
//  5. b's fair_leave (claim "1") gives the grant back; a's grant message comes.
func TestMachineFairLeaveOfSharedEntryKeepsOtherWaiters(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	z, a, aj, gb9 := h.unqueuedHeadBeforeQueued(t)
	aName := registeredName(aj)

	b := h.acquireFair("L", 1)
	h.take().none(t)
	h.reply(gb9, replyInt(1), nil)
	joins := h.take().calls(scripts.FairAcquire)
	var bj scriptCall
	for _, c := range joins {
		if c.waiter == b.id {
			bj = c
		}
		h.reply(c, replyPTTL(30*time.Second), nil)
	}
	if bj.waiter == 0 {
		t.Fatalf("setup: b did not join beside a (joins %d)", len(joins))
	}
	if bw := h.m.waiters[b.id]; bw == nil || !bw.enqueued {
		t.Fatal("setup: b not in the Redis queue")
	}
	h.take()

	h.cancelCtx(b)
	s := h.take()
	for _, c := range s.calls(scripts.FairLeave) {
		if c.args[0] == "cid:1" {
			// Redis ran a release's direct grant to cid:1 first; this leave gives it back.
			h.reply(c, replyInt(2), nil)
			h.fairGrantNotice("L", 1, aName)
			if err, ok := peek(a.future); ok && err == nil {
				t.Fatalf("a granted by the message of a grant b's leave %v gave back: two holders", c.args)
			}
			t.Fatalf("b's leave %v takes out owner 1's entry, on which a still waits", c.args)
		}
	}
	// a retries at once: its call registers it under its own name again, and
	// claims a grant made to the entry meanwhile.
	var ar scriptCall
	for _, c := range s.calls(scripts.FairAcquire) {
		if c.waiter == a.id {
			ar = c
		}
	}
	if ar.waiter == 0 || ar.args[6] != "1" || registeredName(ar) == aName {
		t.Fatalf("after b gave up: %v; want a's retry, claiming, with a fresh registration", s)
	}
	h.reply(ar, replyNil, nil) // claimed the grant
	mustGranted(t, "a", a.future)
	mustPending(t, "z", z.future)
}

// Close with fair waiters in the Redis queue, one of them with its retry in
// flight, and a local holder: every entry leaves the queue.
func TestMachineFairCloseLeavesQueue(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
	h.take()
	var retry timerOp
	for _, o := range []uint64{2, 3, 4} {
		w := h.acquireFair("L", o)
		h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
		for _, op := range h.take().armed(kindFairRetry) {
			if o == 3 && op.key.ID == w.id {
				retry = op
			}
		}
	}
	h.fire(retry.key)
	r3 := h.take().one(t, scripts.FairAcquire)
	h.m.handle(closeMsg{}, h.now)
	s := h.take()
	h.reply(r3, replyPTTL(30*time.Second), nil)
	s2 := h.take()
	leaves := append(leavesOf(s), leavesOf(s2)...)
	slices.Sort(leaves)
	if !slices.Equal(leaves, []string{"cid:2", "cid:3", "cid:4"}) {
		t.Fatalf("leaves %v (close: %v; after: %v)", leaves, s, s2)
	}
}
