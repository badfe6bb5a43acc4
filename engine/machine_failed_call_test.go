package engine

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// fairCallOf returns the FairAcquire call of waiter id in s (zero if none).
func fairCallOf(s step, id uint64) scriptCall {
	for _, c := range s.calls(scripts.FairAcquire) {
		if c.waiter == id {
			return c
		}
	}
	return scriptCall{}
}

// A waiter of owner 1 that is out of the Redis queue heads the local queue, and
// owner 1's other waiter D is in the Redis queue behind another owner's waiter x
// (a refused re-entry requeued by fairRequeue). fairAdvance's first loop retries
// only the leading run of enqueued waiters, which is empty (the head a is not
// enqueued), so a must join for x and D to retry: the join loop must not stop at
// a because D, further back, is in the Redis queue. (It did, for a while, when
// ownerQueued looked at the whole local queue: the whole lock was stranded.)
//
//  1. Another process holds L. a (owner 1) joins, then x (owner 2): Redis
//     queue [cid:1, cid:2].
//  2. Owner 1's TryLock T1 goes; its second TryLock T2 arrives meanwhile and
//     waits (serial.go).
//  3. T1's reply: taken (a's direct grant claimed): owner 1 holds, a is out of
//     the Redis queue but stays at the local head (ownerEntryTaken); it cannot
//     re-enter, owner 1 being busy with T2, sent now.
//  4. Owner 1's Lock D arrives: owner 1 holds, so D is a direct re-entry, and
//     waits for T2.
//  5. T2 re-enters (count 2); D is sent.
//  6. D is refused (owner 1's field is gone on Redis: expired, force-released;
//     another process holds): the stale hold ends, D joined the Redis queue's
//     tail and is requeued behind x: local [a (out), x (in), D (in)].
//  7. a must join (its join finds owner 1's entry, D's), so that x's retry
//     timer, when it fires, makes x attempt again.
func TestMachineFairHeadOutOfQueueStrandedByOwnersRequeuedReentry(t *testing.T) {
	h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
	a := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	x := h.acquireFair("L", 2)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	if aw, xw := h.m.waiters[a.id], h.m.waiters[x.id]; !aw.enqueued || !xw.enqueued {
		t.Fatalf("setup: a and x not both in the Redis queue")
	}

	t1 := h.tryFair("L", 1)
	t1c := h.take().one(t, scripts.FairAcquire)
	t2 := h.tryFair("L", 1)
	h.take().none(t) // waits for T1
	h.reply(t1c, replyNil, nil)
	mustGranted(t, "T1", t1)
	t2c := h.take().one(t, scripts.FairAcquire) // T2's re-entry
	if aw := h.m.waiters[a.id]; aw == nil || aw.enqueued || h.lock("L").queue.head != aw {
		t.Fatalf("setup: a is not the local head out of the Redis queue")
	}
	h.nextID++
	d := &tw{id: h.nextID, future: futures.New[error]()}
	h.m.handle(acquireMsg{id: d.id, lock: "L", owner: 1, fair: true, wait: -1, ctx: context.Background(), future: d.future}, h.now)
	h.take().none(t) // D waits for T2
	h.reply(t2c, replyNil, nil)
	mustGranted(t, "T2", t2)
	dc := h.take().one(t, scripts.FairAcquire)
	if dc.waiter != d.id {
		t.Fatalf("setup: %+v, want D's re-entry", dc)
	}
	h.reply(dc, replyPTTL(30*time.Second), nil) // refused: owner 1's field is gone
	s := h.take()
	if h.hold("L", 1) != nil {
		t.Fatalf("setup: owner 1's stale hold kept")
	}
	if got := h.queueIDs("L"); len(got) != 3 || got[0] != a.id || got[1] != x.id || got[2] != d.id {
		t.Fatalf("setup: local queue %v, want [a x D] = [%d %d %d]", got, a.id, x.id, d.id)
	}
	if c := fairCallOf(s, a.id); c.waiter != 0 {
		h.reply(c, replyPTTL(30*time.Second), nil) // a joined
		h.take()
	}

	// x's retry timer fires: x, the Redis queue's head, must retry (refreshing
	// its deadline, and taking the lock if free).
	h.now = h.now.Add(10 * time.Second)
	xw := h.m.waiters[x.id]
	h.fire(timerKeyFairRetry(xw.id, xw.retryGen))
	s = h.take()
	if fairCallOf(s, x.id).waiter == 0 {
		t.Fatalf("x's retry timer fired and x made no attempt (local queue %v, a enqueued=%v): "+
			"a, out of the Redis queue at the head, never joins (ownerQueued sees D behind x), and only the "+
			"leading run of enqueued waiters retries; calls: %v", h.queueIDs("L"), h.m.waiters[a.id].enqueued, s)
	}
}

// tryLease sends a single try (wait 0) of owner on the plain lock with an
// explicit lease, and returns its future.
func (h *mh) tryLease(lock string, owner uint64, lease time.Duration) *futures.Future[error] {
	h.nextID++
	f := futures.New[error]()
	h.m.handle(acquireMsg{id: h.nextID, lock: lock, owner: owner, lease: lease,
		ctx: context.Background(), future: f}, h.now)
	return f
}

// heldUnderWatchdog returns a machine on which owner 1 holds plain lock "L" under
// the watchdog, count times (re-entered), that hold, and its Lost signal.
func heldUnderWatchdog(t *testing.T, count int) (*mh, *hold, <-chan struct{}) {
	t.Helper()
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	for range count - 1 {
		h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
	}
	hd := h.hold("L", 1)
	return h, hd, hd.lostSignal().C()
}

// sweepRenewal moves the clock to at, fires the watchdog's sweep, and returns the
// one renewal it sends and its send time.
func (h *mh) sweepRenewal(t *testing.T, at time.Time) (scriptCall, time.Time) {
	t.Helper()
	h.now = at
	h.fire(sweepKey)
	return h.take().one(t, scripts.LockRenew), h.now
}

// lostTry sends owner 1's single try on plain lock "L" with lease, a re-entry of
// its hold, and answers it 5 ms later with a transport error (it may have run);
// it returns the try's send time.
func (h *mh) lostTry(t *testing.T, lease time.Duration) time.Time {
	t.Helper()
	h.tryLease("L", 1, lease)
	call := h.take().one(t, scripts.LockAcquire)
	sent := h.now
	h.now = h.now.Add(5 * time.Millisecond)
	h.replyAt(call, sent, scripts.Reply{}, errConn)
	return sent
}

// A renewal already in flight when the short re-entry's reply is lost may have run
// before the re-entry on Redis. Its reply then says nothing about the expiry the
// re-entry set: it must not date the hold from the renewal's send time + 30 s
// (while Redis frees the lock about 1 s after the try ran); another renewal goes.
//
//  1. Owner 1 holds L under the watchdog; at +9 s the sweep sends renewal R0.
//  2. At +9.001 s the same handle's TryLock T with a 1 s lease re-enters.
//  3. Redis runs R0 (pexpire 30 s), then T (count 2, pexpire 1 s). T's reply is
//     lost: the hold's expiry is brought forward to +10.001 s, and no renewal
//     goes (R0 is in flight).
//  4. R0's reply (1): expiresAt = R0's send time + 30 s = +39 s, next renewal at
//     +19 s. Redis frees the lock at about +10 s: another process takes it while
//     the engine says owner 1 holds (Lost open) until +38.5 s.
func TestMachineLostShortReentryNotUndoneByRenewalSentBeforeIt(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	start := h.now
	r0, r0Sent := h.sweepRenewal(t, start.Add(9*time.Second))

	h.now = h.now.Add(time.Millisecond)
	h.tryLease("L", 1, time.Second)
	tc := h.take().one(t, scripts.LockAcquire)
	if tc.args[0] != "1000" {
		t.Fatalf("setup: the try's lease argument is %q", tc.args[0])
	}
	tSent := h.now
	h.now = h.now.Add(5 * time.Millisecond)
	h.replyAt(tc, tSent, scripts.Reply{}, errConn) // ran after R0; its reply is lost
	renewed := len(h.take().calls(scripts.LockRenew)) > 0
	h.now = h.now.Add(time.Millisecond)
	h.replyAt(r0, r0Sent, replyInts(1), nil) // R0 ran before T
	renewed = renewed || len(h.take().calls(scripts.LockRenew)) > 0
	if !renewed && hd.expiresAt.After(tSent.Add(time.Second)) {
		t.Fatalf("after R0's reply the hold expires at +%v from T's send, no renewal went after T's loss; "+
			"R0 may have run before T, and Redis then frees the lock by T's send + 1 s",
			hd.expiresAt.Sub(tSent))
	}
	// And it is not simply lost later than Redis may free it.
	h.now = tSent.Add(time.Second)
	h.fire(timerKeyExpiry(hd.id))
	h.take()
	if !renewed {
		mustFired(t, "Lost by the time Redis may have freed the lock", lost)
	}
}

// expiryFires moves the clock to at, fires hd's expiry entry, and reports whether
// its Lost signal, lost, is closed then.
func (h *mh) expiryFires(hd *hold, lost <-chan struct{}, at time.Time) bool {
	h.now = at
	h.fire(timerKeyExpiry(hd.id))
	h.take()
	select {
	case <-lost:
		return true
	default:
		return false
	}
}

func timerKeyExpiry(id uint64) timer.Key { return timer.Key{Kind: kindExpiry, ID: id} }

// A renewal of a hold whose lease is in doubt is skipped at its reply when the
// owner has a call in flight (onRenewDone), and the next sweep would come too
// late for the shortened deadline (nextRenew is still ~10 s away): another
// renewal must go once the owner is idle, or the hold is declared lost, and its
// field released, although the renewal (and the Unlock, which re-applies the
// lease) kept the lock on Redis for 30 s.
//
//  1. Owner 1 holds L (count 2) under the watchdog.
//  2. Its TryLock T (lease 1 s) re-enters; the reply is lost: expiry brought
//     forward to T's send + 1 s, renewal R sent.
//  3. Its Unlock U (count 2 -> 1) goes.
//  4. R's reply (1) comes while U is in flight: skipped.
//  5. U's reply: 0, still held (lock_release re-applied the 30 s lease).
//  6. At T's send + 600 ms the expiry fires: Lost closes and cid:1 is deleted.
func TestMachineLostShortReentryRenewalSkippedWhileUnlockInFlight(t *testing.T) {
	h, hd, _ := heldUnderWatchdog(t, 2)
	start := h.now
	if hd.count != 2 {
		t.Fatalf("setup: count %d", hd.count)
	}
	lost := hd.lostSignal().C()

	h.now = start.Add(time.Second)
	tSent := h.lostTry(t, time.Second)
	r := h.take().one(t, scripts.LockRenew)
	rSent := h.now

	uc, u := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.now = h.now.Add(2 * time.Millisecond)
	h.replyAt(r, rSent, replyInts(1), nil) // R ran: 30 s from now on Redis
	h.reply(uc, replyInt(0), nil)          // U ran: count 1, lease re-applied
	mustGranted(t, "unlock", u)
	h.take()

	h.now = tSent.Add(600 * time.Millisecond)
	h.fire(timerKeyExpiry(hd.id))
	s := h.take()
	select {
	case <-lost:
		t.Fatalf("the hold was declared lost (and %d release(s) sent) at T's send + 600 ms, although its "+
			"renewal R succeeded (its reply skipped while the Unlock was in flight) and the Unlock re-applied "+
			"the 30 s lease; Redis holds cid:1 for ~30 s", len(s.calls(scripts.LockReleaseOwner)))
	default:
	}
}

// The shortened expiry is armed with the margin of the hold's own lease
// (the watchdog's 30 s: 500 ms), not of the lease that set it. With a re-entry
// lease of 500 ms or less, the deadline is already past: the hold is lost (and
// its field released) on the next tick, before the renewal sent at once can
// answer, although Redis holds the lock for up to the try's lease and the
// renewal extends it to 30 s. The renewal is then wasted.
func TestMachineLostSubsecondReentryLosesHoldBeforeItsRenewal(t *testing.T) {
	h, hd, lost := heldUnderWatchdog(t, 1)
	h.now = h.now.Add(time.Second)
	h.lostTry(t, 400*time.Millisecond)
	s := h.take()
	r := s.one(t, scripts.LockRenew)
	if ops := s.armed(kindExpiry); len(ops) == 1 && ops[0].d == 0 {
		t.Logf("expiry armed to fire at once (deadline T's send + 400 ms - 500 ms)")
	}
	h.now = h.now.Add(time.Millisecond) // the next tick; R still in flight
	h.fire(timerKeyExpiry(hd.id))
	s = h.take()
	select {
	case <-lost:
		t.Fatalf("the hold was lost 6 ms after the try's send (release sent: %d), with ~394 ms of the try's "+
			"lease left and renewal %v in flight", len(s.calls(scripts.LockReleaseOwner)), r.args)
	default:
	}
}

// BenchmarkFairJoinBurst: n fair waiters of distinct owners arrive at once on a
// lock held elsewhere; their joins go out a batch (maxJoin) at a time and are
// answered "queued". Then one more waiter joins behind the n queued ones.
func BenchmarkFairJoinBurst(b *testing.B) {
	for _, n := range []int{100, 1000, 5000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				t := &testing.T{}
				h := newMH(t, func(c *config) { c.fairWait = 5 * time.Minute })
				ctx := context.Background()
				for j := 0; j < n; j++ {
					h.nextID++
					h.m.handle(acquireMsg{id: h.nextID, lock: "L", owner: uint64(j + 1), fair: true, wait: -1, ctx: ctx, future: futures.New[error]()}, h.now)
				}
				for {
					cs := h.take().calls(scripts.FairAcquire)
					if len(cs) == 0 {
						break
					}
					for _, c := range cs {
						h.reply(c, replyPTTL(30*time.Second), nil)
					}
				}
			}
		})
	}
}
