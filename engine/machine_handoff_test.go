package engine

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// The early grant (handoff.go): a local handoff below the chain bound grants the
// receiver when the Unlock arrives, under the releasing owner's lease, and the
// reply confirms or ends that hold.
func TestMachineEarlyHandoff(t *testing.T) {
	// setup: owner 1 holds L under the watchdog, owner 2 waits with a 5 s lease, and
	// owner 1 unlocks. It returns the handoff call and owner 1's Unlock future.
	setup := func(t *testing.T) (h *mh, b *tw, c scriptCall, unlocked *futures.Future[error]) {
		h = newMH(t)
		a := h.grantFresh("L", 1, 0)
		b = h.acquire("L", 2, 5*time.Second, -1)
		h.take().none(t)
		h.now = h.now.Add(time.Second)
		f := h.unlock("L", a.owner)
		c = h.take().one(t, scripts.LockHandoff)
		if want := []string{"cid:1", "30000", "cid:2", "5000", "0", "0", "0", "cid", "0", "", strconv.FormatUint(b.id, 10), "1"}; !slices.Equal(c.args, want) {
			t.Fatalf("args %v, want %v", c.args, want)
		}
		if !c.early {
			t.Fatal("handoff not marked early")
		}
		if len(b.future.C()) != 1 { // not received: a test may still take it back
			t.Fatal("receiver not granted before the reply")
		}
		mustPending(t, "unlock before the reply", f)
		return h, b, c, f
	}

	t.Run("confirmed", func(t *testing.T) {
		h, _, c, f := setup(t)
		hb := h.hold("L", 2)
		if h.hold("L", 1) != nil || hb == nil || !hb.provisional || hb.count != 1 {
			t.Fatalf("holds: releaser %v, receiver %+v; want only a provisional receiver", h.hold("L", 1), hb)
		}
		if want := h.now.Add(5 * time.Second); hb.expiresAt.After(want) {
			t.Errorf("provisional expiry %v, after the receiver's lease from now (%v)", hb.expiresAt, want)
		}
		sentAt := h.now
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(c, sentAt, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		if hb.provisional || !hb.expiresAt.Equal(sentAt.Add(5*time.Second)) {
			t.Errorf("confirmed hold: provisional %v, expires %v; want the lease from the call's send time", hb.provisional, hb.expiresAt)
		}
		if st := h.m.snapshot(); st.Handoffs != 1 || st.EarlyGrants != 1 || st.Holds != 1 || st.Waiters != 0 {
			t.Errorf("stats %+v", st)
		}
		h.take().none(t)
	})

	t.Run("the provisional expiry is the releasing owner's", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 2*time.Second)
		h.acquire("L", 2, 0, -1) // the watchdog's 30 s would outlast owner 1's lease
		h.take()
		h.unlock("L", a.owner)
		h.take().one(t, scripts.LockHandoff)
		if got, want := h.hold("L", 2).expiresAt, h.now.Add(2*time.Second); !got.Equal(want) {
			t.Errorf("provisional expiry %v, want owner 1's %v", got, want)
		}
	})

	t.Run("the receiver's calls wait for the reply", func(t *testing.T) {
		h, _, c, _ := setup(t)
		next := h.acquire("L", 3, 0, -1)
		f2 := h.unlock("L", 2)
		h.take().none(t) // neither the Unlock nor a handoff to owner 3 is sent yet
		h.reply(c, replyInt(2), nil)
		c2 := h.take().one(t, scripts.LockHandoff)
		if c2.args[0] != "cid:2" || c2.args[2] != "cid:3" {
			t.Fatalf("second handoff args %v, want cid:2 to cid:3", c2.args)
		}
		mustGranted(t, "owner 3", next.future)
		h.reply(c2, replyInt(2), nil)
		mustGranted(t, "owner 2's unlock", f2)
	})

	t.Run("releasing owner had lost it (reply nil)", func(t *testing.T) {
		h, _, c, f := setup(t)
		lost := h.hold("L", 2).lostSignal().C()
		h.reply(c, replyNil, nil)
		if err := mustGet(t, "unlock", f); !errors.Is(err, ErrLockLost) {
			t.Fatalf("unlock got %v, want ErrLockLost", err)
		}
		mustFired(t, "receiver's Lost", lost)
		if h.hold("L", 2) != nil {
			t.Error("receiver's hold kept")
		}
		h.take().none(t) // nothing of owner 2's is on the server
	})

	t.Run("releasing owner counted more (reply 0)", func(t *testing.T) {
		h, _, c, f := setup(t)
		lost := h.hold("L", 2).lostSignal().C()
		h.reply(c, replyInt(0), nil)
		mustGranted(t, "unlock", f)
		mustFired(t, "receiver's Lost", lost)
		r := h.take().one(t, scripts.LockReleaseOwner)
		if want := []string{"0", "cid:1", "0"}; !slices.Equal(r.args, want) {
			t.Errorf("release_owner args %v, want %v (owner 1's surplus)", r.args, want)
		}
	})

	t.Run("transport error, retry finds it handed over", func(t *testing.T) {
		h, _, c, f := setup(t)
		firstSent := h.now
		h.now = h.now.Add(3 * time.Second) // the connection's timeout
		h.replyAt(c, firstSent, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.LockHandoff)
		want := slices.Clone(c.args)
		want[6] = "1"
		if !retry.retried || !slices.Equal(retry.args, want) {
			t.Fatalf("retry args %v (retried %v), want %v: the same handoff, flagged as a retry", retry.args, retry.retried, want)
		}
		mustPending(t, "unlock during the retry", f)
		h.unlock("L", 2)
		h.take().none(t) // still waits for the handoff
		h.reply(retry, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		hb := h.hold("L", 2)
		if hb == nil || hb.provisional {
			t.Fatalf("receiver's hold %+v, want a confirmed hold", hb)
		}
		if want := firstSent.Add(5 * time.Second); !hb.expiresAt.Equal(want) {
			t.Errorf("lease runs to %v, want %v (from the first try's send time)", hb.expiresAt, want)
		}
		h.take().one(t, scripts.LockRelease) // owner 2's Unlock, now
	})

	t.Run("transport error, retry finds nothing handed over", func(t *testing.T) {
		h, _, c, f := setup(t)
		lost := h.hold("L", 2).lostSignal().C()
		h.reply(c, scripts.Reply{}, errConn)
		h.reply(h.take().one(t, scripts.LockHandoff), replyNil, nil)
		if err := mustGet(t, "unlock", f); !errors.Is(err, ErrLockLost) {
			t.Fatalf("unlock got %v, want ErrLockLost", err)
		}
		mustFired(t, "receiver's Lost", lost)
		h.take().none(t)
	})

	t.Run("no queued attempt while the handoff is in flight", func(t *testing.T) {
		h, _, c, _ := setup(t)
		other := h.acquire("L", 1, 0, -1) // the releasing owner wants it back
		h.notice("L")                     // and a release elsewhere is heard
		h.fire(timer.Key{Kind: kindRetry, ID: h.lockID("L"), Gen: h.lock("L").retryGen})
		h.take().none(t)
		h.reply(c, replyInt(2), nil)
		mustPending(t, "the releasing owner's new Lock", other.future)
	})

	t.Run("transport error twice", func(t *testing.T) {
		h, _, c, f := setup(t)
		lost := h.hold("L", 2).lostSignal().C()
		h.reply(c, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.LockHandoff)
		h.reply(retry, scripts.Reply{}, errConn)
		if err := mustGet(t, "unlock", f); !errors.Is(err, errConn) {
			t.Fatalf("unlock got %v, want the transport error", err)
		}
		mustFired(t, "receiver's Lost", lost)
		var owners []string
		for _, r := range h.take().calls(scripts.LockReleaseOwner) {
			owners = append(owners, r.args[1]+"/"+r.args[2])
		}
		if want := []string{"cid:1/0", "cid:2/1"}; !slices.Equal(owners, want) {
			t.Errorf("owner-guarded releases %v, want %v (both fields may be on the server; the receiver's holds the grant's one count)", owners, want)
		}
	})

	t.Run("grant taken back waits for the reply", func(t *testing.T) {
		h, b, c, _ := setup(t)
		h.cancelCtx(b) // the caller walked away without receiving the grant
		if err := mustGet(t, "receiver", b.future); !errors.Is(err, b.ctx.Err()) {
			t.Fatalf("receiver got %v, want its context's error", err)
		}
		if h.hold("L", 2) != nil {
			t.Fatal("revoked hold kept")
		}
		h.take().none(t) // its release would reach Redis before the handoff
		h.reply(c, replyInt(2), nil)
		r := h.take().one(t, scripts.LockReleaseOwner)
		if want := []string{"0", "cid:2", "1"}; !slices.Equal(r.args, want) {
			t.Errorf("release_owner args %v, want %v", r.args, want)
		}
	})

	t.Run("close waits for the reply to release", func(t *testing.T) {
		h, _, c, f := setup(t)
		lost := h.hold("L", 2).lostSignal().C()
		h.m.handle(closeMsg{}, h.now)
		mustFired(t, "receiver's Lost", lost)
		if s := h.take(); len(s.calls(scripts.LockReleaseOwner)) != 0 {
			t.Fatalf("a release before the handoff's reply: %v", s)
		}
		h.reply(c, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		r := h.take().one(t, scripts.LockReleaseOwner)
		if r.args[1] != "cid:2" {
			t.Errorf("release_owner args %v, want owner 2's", r.args)
		}
	})

	t.Run("not while the receiver's owner has a call in flight", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 0)
		b := h.acquire("L", 2, 0, -1)
		h.acquire("L", 2, 0, 0) // the same handle's single try, in flight
		h.take().one(t, scripts.LockAcquire)
		h.unlock("L", a.owner)
		// No handoff at all: it is the waiter's attempt, which waits for the
		// owner's call (TestMachineOrderNoHandoffToOwnerWithCallInFlight).
		h.take().one(t, scripts.LockRelease)
		mustPending(t, "receiver", b.future)
	})
}

// A handoff at the chain bound that the script still made (nobody else listened)
// starts a new chain: the next handoff is below the bound and grants early.
func TestMachineChainBoundHandedOverStartsNewChain(t *testing.T) {
	h := newMH(t, func(c *config) { c.handoffChain, c.handoffAge = 1, time.Hour })
	a := h.grantFresh("L", 1, 0)
	h.acquire("L", 2, 0, -1)
	h.acquire("L", 3, 0, -1)
	h.acquire("L", 4, 0, -1)
	h.take()

	first := func(owner uint64) scriptCall {
		t.Helper()
		h.unlock("L", owner)
		return h.take().one(t, scripts.LockHandoff)
	}
	c := first(a.owner)
	if !c.early || c.args[4] != "0" {
		t.Fatalf("first handoff: early %v, bound %q; want early and unbounded", c.early, c.args[4])
	}
	h.reply(c, replyInt(5), nil) // somebody else listened then
	c = first(2)
	if c.early || c.args[4] != "1" {
		t.Fatalf("second handoff: early %v, bound %q; want the bound, not early", c.early, c.args[4])
	}
	h.reply(c, replyInt(2), nil) // handed over all the same: nobody else listened
	if c = first(3); !c.early || c.args[4] != "0" {
		t.Fatalf("third handoff: early %v, bound %q; want a new chain, early", c.early, c.args[4])
	}
}

// Every plain handoff asks whether anybody else listens (ARGV[12]). At the chain
// bound, when the chain's last handoff said nobody did (2), the engine skips the
// check: the handoff goes unbounded and early, and a new chain starts. A reply of
// 5 (somebody listened) brings the check back at the next bound, and a quiet reply
// sent before the chain began does not count (noteListeners).
func TestMachineChainBoundSkippedWhenNobodyElseListened(t *testing.T) {
	h := newMH(t, func(c *config) { c.handoffChain, c.handoffAge = 2, time.Hour })
	a := h.grantFresh("L", 1, 0)
	for owner := uint64(2); owner <= 10; owner++ {
		h.acquire("L", owner, 0, -1)
	}
	h.take()
	owner := a.owner
	// next unlocks the current holder; the handoff goes to the next owner.
	next := func(i int, wantBound bool) scriptCall {
		t.Helper()
		h.unlock("L", owner)
		c := h.take().one(t, scripts.LockHandoff)
		if len(c.args) < 12 || c.args[11] != "1" {
			t.Fatalf("handoff %d: args %v, want the listener question (ARGV[12] = 1)", i, c.args)
		}
		if bound := c.args[4] == "1"; bound != wantBound || c.early == wantBound {
			t.Fatalf("handoff %d: bound %v, early %v; want bound %v", i, bound, c.early, wantBound)
		}
		owner++
		return c
	}
	h.reply(next(1, false), replyInt(2), nil) // nobody else listens
	h.reply(next(2, false), replyInt(2), nil)
	h.reply(next(3, false), replyInt(5), nil) // the bound, skipped (a new chain); now somebody listens
	h.reply(next(4, false), replyInt(5), nil)
	h.reply(next(5, true), replyInt(2), nil) // the bound, checked: nobody listened, handed over
	// A new chain whose handoffs' replies say nothing (a retry's reply may come
	// from its first try's early return): the quiet reply above predates the
	// chain, so its bound is checked.
	h.now = h.now.Add(time.Millisecond)
	for i := 6; i <= 7; i++ {
		c := next(i, false)
		c.retried = true
		h.reply(c, replyInt(2), nil)
	}
	next(8, true)
}

// Settle (HoldCount's first step) waits for the owner's handoff in flight.
func TestMachineSettleWaitsForEarlyHandoff(t *testing.T) {
	h := newMH(t)
	a := h.grantFresh("L", 1, 0)
	h.acquire("L", 2, 0, -1)
	h.take()
	h.unlock("L", a.owner)
	c := h.take().one(t, scripts.LockHandoff)

	settled := h.settle("L", 2)
	other := h.settle("L", 3)
	mustGranted(t, "another owner's settle", other)
	mustPending(t, "the receiver's settle while the handoff is in flight", settled)
	h.reply(c, replyInt(2), nil)
	mustGranted(t, "the receiver's settle after the reply", settled)
}

// Settle waits for a handoff to the owner's waiter that did not grant early, too:
// that call is the waiter's attempt. An Acquire whose caller walked away during it
// has returned; a HoldCount after the owner's next call must count the grant the
// handoff makes, and it goes back only when the reply is in (a storm read
// HoldCount 1 after a Lock failed, the walked-away Acquire's grant then still on
// the server, 1 run in 50).
func TestMachineSettleWaitsForPlainHandoff(t *testing.T) {
	h := newMH(t)
	a := h.grantFresh("L", 1, 50*time.Millisecond) // too little lease left to grant early
	b := h.acquire("L", 2, 0, -1)
	h.take()
	h.unlock("L", a.owner)
	c := h.take().one(t, scripts.LockHandoff)
	if c.early {
		t.Fatal("setup: the handoff granted early")
	}
	b.cancel() // the caller walks away; its cancelMsg has not come yet
	settled := h.settle("L", 2)
	mustPending(t, "the receiver's settle while the handoff is in flight", settled)
	mustGranted(t, "another owner's settle", h.settle("L", 3))
	h.m.handle(cancelMsg{id: b.id, err: b.ctx.Err()}, h.now)
	h.reply(c, replyInt(2), nil) // handed over: the grant goes back
	gb := h.take().one(t, scripts.LockReleaseOwner)
	mustPending(t, "the receiver's settle while the grant goes back", settled)
	h.reply(gb, replyInt(1), nil)
	mustGranted(t, "the receiver's settle after the give-back", settled)
	if _, busy := h.m.serial[holdKey{h.lockID("L"), 2}]; busy {
		t.Error("the receiver's serialization state outlived the handoff")
	}
}

// A waiter whose attempt failed on the connection (it may have run) and whose plain
// handoff is then refused after it was cancelled cleans up what that attempt may
// have taken: the handoff, which keeps its owner busy until its reply is read, is
// not another call of the owner's that the cleanup must wait for (found in review:
// the lock stayed held for nobody until its lease ran out).
func TestMachineRefusedHandoffCleansUpAmbiguousAttempt(t *testing.T) {
	h := newMH(t)
	a := h.grantFresh("L", 1, 50*time.Millisecond) // too little lease left to grant early
	b := h.acquire("L", 2, 0, -1)
	h.take()
	h.notice("L")
	h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn) // may have run
	h.take()
	h.unlock("L", a.owner)
	c := h.take().one(t, scripts.LockHandoff)
	if c.early {
		t.Fatal("setup: the handoff granted early")
	}
	h.cancelCtx(b)
	h.reply(c, replyNil, nil) // a's field was gone: not handed over
	cleanups := h.take().calls(scripts.LockReleaseOwner)
	if len(cleanups) != 1 || cleanups[0].args[1] != "cid:2" {
		t.Fatalf("cleanups %v, want one of owner 2's field", cleanups)
	}
	if err := mustGet(t, "the cancelled waiter", b.future); !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled waiter got %v, want context.Canceled", err)
	}
}

// Settle also waits for the owner's abandon in flight: the give-back of a grant
// whose caller's context ended first. Until its reply, Redis still counts it.
func TestMachineSettleWaitsForAbandon(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	h.cancelCtx(w)
	c := h.take().one(t, scripts.LockReleaseOwner)

	settled := h.settle("L", 1)
	other := h.settle("L", 2)
	mustGranted(t, "another owner's settle", other)
	mustPending(t, "the owner's settle while its abandon is in flight", settled)
	h.reply(c, replyInt(1), nil)
	mustGranted(t, "the owner's settle after the abandon's reply", settled)
	if n := len(h.m.giveBacks) + len(h.m.afterGiveBacks); n != 0 {
		t.Errorf("%d abandon or settle entries left", n)
	}

	// A Settle still waiting for an abandon at Close is answered ErrClosed.
	w = h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	h.cancelCtx(w)
	h.take().one(t, scripts.LockReleaseOwner)
	waiting := h.settle("L", 1)
	mustPending(t, "settle behind the abandon", waiting)
	h.m.handle(closeMsg{}, h.now)
	if err := mustGet(t, "waiting settle at Close", waiting); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
}

// A fair waiter that leaves the Redis queue with nothing held may give back a
// direct grant it did not hear of: Settle waits for that leave too.
func TestMachineSettleWaitsForFairGiveBack(t *testing.T) {
	h := newMH(t)
	w := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // queued in Redis
	h.take()
	h.cancelCtx(w)
	leave := h.take().one(t, scripts.FairLeave)
	if leave.args[4] != "1" {
		t.Fatalf("leave args %v: want one that gives back an unheard grant", leave.args)
	}
	settled := h.settle("L", 1)
	mustPending(t, "the owner's settle while its leave is in flight", settled)
	h.reply(leave, replyInt(2), nil)
	mustGranted(t, "the owner's settle after the leave's reply", settled)
	if n := len(h.m.giveBacks) + len(h.m.afterGiveBacks); n != 0 {
		t.Errorf("%d give-back or settle entries left", n)
	}
}

// A Settle that comes before the cancellation of a waiter whose context has ended
// (an Acquire walked away; context.AfterFunc posts its cancelMsg later) cancels it
// itself and waits for what that sends: another process's release may have granted
// the fair waiter's field already, and its leave gives that back.
func TestMachineSettleCancelsWalkedAwayWaiter(t *testing.T) {
	h := newMH(t)
	w := h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil) // queued in Redis
	h.take()
	w.cancel() // its cancelMsg has not come yet
	settled := h.settle("L", 1)
	leave := h.take().one(t, scripts.FairLeave)
	if leave.args[4] != "1" {
		t.Fatalf("leave args %v: want one that gives back an unheard grant", leave.args)
	}
	if err := mustGet(t, "the walked-away waiter", w.future); !errors.Is(err, context.Canceled) {
		t.Fatalf("the walked-away waiter got %v, want context.Canceled", err)
	}
	mustPending(t, "the owner's settle while its leave is in flight", settled)
	h.reply(leave, replyInt(2), nil)
	mustGranted(t, "the owner's settle after the leave's reply", settled)
	h.m.handle(cancelMsg{id: w.id, err: w.ctx.Err()}, h.now) // late: nothing left to do
	h.take().none(t)
}

// A Settle waits only for the give-backs in flight when it came: later ones could
// otherwise hold HoldCount up for good.
func TestMachineSettleNotStarvedByLaterGiveBacks(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	k := holdKey{h.lockID("L"), 1}
	first := h.m.startGiveBack(k)
	settled := h.settle("L", 1)
	second, third := h.m.startGiveBack(k), h.m.startGiveBack(k)
	mustPending(t, "the settle while the first give-back is in flight", settled)
	h.m.giveBackDone(k, first, h.now)
	mustGranted(t, "the settle once the give-back it came after is answered", settled)

	late := h.settle("L", 1)
	h.m.giveBackDone(k, third, h.now)
	mustPending(t, "a settle behind the second give-back", late)
	h.m.giveBackDone(k, second, h.now)
	mustGranted(t, "the settle after both", late)
	if n := len(h.m.giveBacks) + len(h.m.afterGiveBacks); n != 0 {
		t.Errorf("%d give-back or parked entries left", n)
	}
}

// No local handoff goes to an owner whose give-back is in flight (the handoff could
// run first, and the give-back then undo the grant): the lock is released, and the
// owner's attempt waits for the give-back's reply. Its Unlock and its Settle wait
// for it too.
func TestMachineNoHandoffToOwnerGivingBack(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	h.cancelCtx(w)
	giveBack := h.take().one(t, scripts.LockReleaseOwner)

	b := h.acquire("L", 2, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	h.take()
	mustGranted(t, "owner 2", b.future)
	again := h.acquire("L", 1, 0, -1)
	h.take()
	f := h.unlock("L", 2)
	release := h.take().one(t, scripts.LockRelease)
	h.reply(release, replyInt(1), nil)
	mustGranted(t, "owner 2's unlock", f)
	h.notice("L")
	h.take().none(t) // owner 1's attempt waits for its give-back
	settled := h.settle("L", 1)
	mustPending(t, "owner 1's settle", settled)

	h.reply(giveBack, replyInt(1), nil)
	mustGranted(t, "owner 1's settle after the give-back", settled)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	mustGranted(t, "owner 1's Lock", again.future)
}

// A request parked behind its owner's serialized call waits, once handled again,
// for the give-backs that started meanwhile: its bound is set when it gets past
// the serialized call, not when it first came.
func TestMachineGiveBackBoundAfterSerializedCall(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	k := holdKey{h.lockID("L"), 1}
	h.m.markBusy(k) // a serialized call of owner 1's in flight
	f := h.unlock("L", 1)
	h.take().none(t)
	seq := h.m.startGiveBack(k) // a give-back sent while the Unlock waits
	h.m.markIdle(k, h.now)
	if s := h.take(); len(s.scripts) != 0 {
		t.Fatalf("the Unlock went out before the give-back's reply: %v", s.scripts[0].script)
	}
	h.m.giveBackDone(k, seq, h.now)
	h.reply(h.take().one(t, scripts.LockRelease), replyInt(1), nil)
	mustGranted(t, "unlock", f)
}

// A direct acquire parked behind its owner's call is answered when its context
// ends: it is no waiter yet, and its caller waits for the answer.
func TestMachineParkedDirectAcquireCancelled(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	h.m.markBusy(holdKey{h.lockID("L"), 1})
	w := h.acquire("L", 1, 0, -1) // a re-entry
	h.take().none(t)
	h.cancelCtx(w)
	if err := mustGet(t, "the parked re-entry", w.future); err != context.Canceled {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if len(h.m.parkedAcquires) != 0 || len(h.m.serial[holdKey{h.lockID("L"), 1}].pending) != 0 {
		t.Error("the cancelled re-entry is still parked")
	}
}

// With deferGrants (as the Engine runs it), a grant's future completes after the
// step's effects are carried out (flushGrants), or at the latest when the next
// message is handled, so a cancellation in that message still finds the grant
// unreceived and takes it back.
func TestMachineDeferredGrants(t *testing.T) {
	t.Run("flushed after the step", func(t *testing.T) {
		h := newMH(t)
		h.m.deferGrants = true
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		mustPending(t, "grant before the flush", w.future)
		h.m.flushGrants()
		mustGranted(t, "grant after the flush", w.future)
	})
	t.Run("flushed before the next message", func(t *testing.T) {
		h := newMH(t)
		h.m.deferGrants = true
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		h.cancelCtx(w) // the caller walked away before receiving
		if err := mustGet(t, "grant taken back", w.future); !errors.Is(err, w.ctx.Err()) {
			t.Fatalf("got %v, want the context's error", err)
		}
		if r := h.take().one(t, scripts.LockReleaseOwner); r.args[1] != "cid:1" {
			t.Errorf("release_owner args %v, want owner 1's", r.args)
		}
	})
}

// Regressions found in review: while an early handoff is in flight, nothing of the
// lock's queued waiters may reach Redis (it could re-enter, or take after a
// force-release, a field the handoff is about to swap or its cleanup to delete),
// and a lost provisional hold's cleanup drops only the grant's count.
func TestMachineEarlyHandoffRaces(t *testing.T) {
	// order lists the step's script calls as "acquire:<waiter>" and
	// "release_owner:<field>/<drop>", in the order they are sent.
	order := func(s step) []string {
		var out []string
		for _, c := range s.scripts {
			switch c.script {
			case scripts.LockAcquire:
				out = append(out, "acquire:"+strconv.FormatUint(c.waiter, 10))
			case scripts.LockReleaseOwner:
				out = append(out, "release_owner:"+c.args[1]+"/"+c.args[2])
			}
		}
		return out
	}

	t.Run("provisional hold lost, the same owner waits again", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, time.Second)
		h.acquire("L", 2, 5*time.Second, -1)
		w2 := h.acquire("L", 2, 5*time.Second, -1) // the same handle, another goroutine
		h.take()
		h.now = h.now.Add(500 * time.Millisecond)
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		nb := h.hold("L", 2)
		lost := nb.lostSignal().C()
		h.now = nb.expiresAt
		h.fire(timer.Key{Kind: kindExpiry, ID: nb.id}) // the reply is late
		mustFired(t, "provisional hold's Lost", lost)
		if got := order(h.take()); len(got) != 0 {
			t.Fatalf("calls while the handoff is in flight: %v", got)
		}
		h.reply(c, replyInt(2), nil)
		// The lost grant's count goes; the other waiter's attempt waits for that
		// give-back's reply, then takes the lock afresh.
		s := h.take()
		if got, want := order(s), []string{"release_owner:cid:2/1"}; !slices.Equal(got, want) {
			t.Fatalf("calls after the reply %v, want %v", got, want)
		}
		h.reply(s.one(t, scripts.LockReleaseOwner), replyInt(1), nil)
		if got, want := order(h.take()), []string{"acquire:" + strconv.FormatUint(w2.id, 10)}; !slices.Equal(got, want) {
			t.Fatalf("calls after the give-back's reply %v, want %v", got, want)
		}
	})

	t.Run("failed twice, the releasing owner waits again", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, time.Second)
		h.acquire("L", 2, 5*time.Second, -1)
		h.take()
		h.now = h.now.Add(500 * time.Millisecond)
		releaserLost := h.hold("L", 1).lostSignal().C()
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		again := h.acquire("L", 1, 5*time.Second, -1)
		h.reply(c, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.LockHandoff)
		nb := h.hold("L", 2)
		h.now = nb.expiresAt
		h.fire(timer.Key{Kind: kindExpiry, ID: nb.id})
		if got := order(h.take()); len(got) != 0 {
			t.Fatalf("calls while the retry is in flight: %v", got)
		}
		h.reply(retry, scripts.Reply{}, errConn)
		mustFired(t, "the releasing hold's Lost (its field is abandoned)", releaserLost)
		s := h.take()
		want := []string{"release_owner:cid:1/0", "release_owner:cid:2/1"}
		if got := order(s); !slices.Equal(got, want) {
			t.Fatalf("calls after the second failure %v, want %v", got, want)
		}
		// Both fields go before a new attempt of owner 1's: it waits for its
		// give-back's reply.
		for _, g := range s.calls(scripts.LockReleaseOwner) {
			h.reply(g, replyInt(1), nil)
		}
		if got, want := order(h.take()), []string{"acquire:" + strconv.FormatUint(again.id, 10)}; !slices.Equal(got, want) {
			t.Fatalf("calls after the give-backs' replies %v, want %v", got, want)
		}
	})

	t.Run("force-release before the handoff runs", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 5*time.Second, -1)
		h.take()
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		again := h.acquire("L", 1, 0, -1)
		h.now = h.now.Add(time.Millisecond)
		ff := futures.New[forceResult]()
		h.m.handle(forceUnlockMsg{lock: "L", future: ff}, h.now)
		h.reply(h.take().one(t, scripts.LockForceRelease), replyInt(1), nil)
		if got := order(h.take()); len(got) != 0 {
			t.Fatalf("calls while the handoff is in flight: %v", got)
		}
		h.reply(c, replyInt(2), nil) // the handoff ran first; the force-release then deleted the key
		want := []string{"release_owner:cid:2/1", "acquire:" + strconv.FormatUint(again.id, 10)}
		if got := order(h.take()); !slices.Equal(got, want) {
			t.Fatalf("calls after the reply %v, want %v", got, want)
		}
	})
}

// The early handoff's races end with the engine and Redis agreeing, checked
// against the in-memory model of the scripts (memRedis), each step's calls run in
// order as one batch. Owner 2 waits twice (one handle, two goroutines); its first
// waiter is granted early and then loses that hold.
func TestMachineEarlyHandoffRacesAgainstModel(t *testing.T) {
	run := func(r *memRedis, calls ...scriptCall) []scripts.Reply {
		var out []scripts.Reply
		for _, c := range calls {
			var pub [][2]string
			r.mu.Lock()
			out = append(out, r.run(c.script, c.keys, c.args, &pub))
			r.mu.Unlock()
		}
		return out
	}
	setup := func(t *testing.T) (*mh, *memRedis, scriptCall, *tw) {
		h := newMH(t)
		r := newMemRedis()
		a := h.grantFresh("L", 1, 0)
		r.set("L", "cid:1", 1, 30*time.Second)
		h.acquire("L", 2, 5*time.Second, -1)
		w2 := h.acquire("L", 2, 5*time.Second, -1)
		h.take()
		h.unlock("L", a.owner)
		return h, r, h.take().one(t, scripts.LockHandoff), w2
	}
	// finish runs the step after the handoff's reply, answers it, and compares.
	finish := func(t *testing.T, h *mh, r *memRedis, w2 *tw) {
		t.Helper()
		// Steps until nothing more is sent: an attempt waits for the give-backs'
		// replies.
		for range 4 {
			s := h.take()
			if len(s.scripts) == 0 {
				break
			}
			for i, rep := range run(r, s.scripts...) {
				h.reply(s.scripts[i], rep, nil)
			}
		}
		mustGranted(t, "owner 2's other waiter", w2.future)
		if hb := h.hold("L", 2); hb == nil || r.holders("L")["cid:2"] != int64(hb.count) {
			t.Errorf("engine: owner 2's hold %+v; Redis: %v", hb, r.holders("L"))
		}
	}
	force := func(h *mh) scriptCall {
		h.m.handle(forceUnlockMsg{lock: "L", future: futures.New[forceResult]()}, h.now)
		return h.take().one(t, scripts.LockForceRelease)
	}

	for _, forceFirst := range []bool{false, true} {
		name := "handoff, then a force-release"
		if forceFirst {
			name = "a force-release, then the handoff"
		}
		t.Run(name, func(t *testing.T) {
			h, r, c, w2 := setup(t)
			fc := force(h)
			var rc, rf scripts.Reply
			if forceFirst {
				rf, rc = run(r, fc)[0], run(r, c)[0]
			} else {
				rc, rf = run(r, c)[0], run(r, fc)[0]
			}
			h.reply(fc, rf, nil) // the force-release's reply comes first either way
			h.reply(c, rc, nil)
			finish(t, h, r, w2)
		})
	}
	t.Run("neither try ran", func(t *testing.T) {
		h, r, c, w2 := setup(t)
		h.reply(c, scripts.Reply{}, errConn)
		h.reply(h.take().one(t, scripts.LockHandoff), scripts.Reply{}, errConn)
		finish(t, h, r, w2)
	})
}

// A Settle waiting behind a handoff, or arriving after Close, is answered
// ErrClosed: Close's releases may still be in flight, so Redis is no answer then.
func TestMachineSettleOnClose(t *testing.T) {
	h := newMH(t)
	a := h.grantFresh("L", 1, 0)
	h.acquire("L", 2, 0, -1)
	h.take()
	h.unlock("L", a.owner)
	h.take().one(t, scripts.LockHandoff)
	waiting := h.settle("L", 2)
	mustPending(t, "settle behind the handoff", waiting)
	h.m.handle(closeMsg{}, h.now)
	if err := mustGet(t, "waiting settle at Close", waiting); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
	late := h.settle("L", 3)
	if err := mustGet(t, "settle after Close", late); !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
}

// A fair lock's handoff grants early only to a waiter the last handoff's reply
// said heads the Redis queue (3), and then tells fair_handoff so (ARGV[8]); its
// retry after a transport error keeps every argument and flags itself (ARGV[10]).
func TestMachineFairEarlyHandoff(t *testing.T) {
	// setup: owner 1 holds fair lock L; owners 2 and 3 queue behind it in Redis.
	setup := func(t *testing.T) (h *mh, b, c *tw) {
		h = newMH(t)
		h.acquireFair("L", 1)
		h.reply(h.take().one(t, scripts.FairAcquire), scripts.Reply{Nil: true}, nil)
		h.take()
		b = h.acquireFair("L", 2)
		h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
		h.take()
		c = h.acquireFair("L", 3)
		h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
		h.take()
		return h, b, c
	}
	// handOff unlocks owner's hold and returns its fair_handoff call.
	handOff := func(t *testing.T, h *mh, owner uint64) (scriptCall, *futures.Future[error]) {
		t.Helper()
		f := h.unlock("L", owner)
		return h.take().one(t, scripts.FairHandoff), f
	}

	t.Run("reply 3 makes the next handoff early", func(t *testing.T) {
		h, b, c := setup(t)
		call, f := handOff(t, h, 1)
		if call.early || call.args[7] != "0" || call.args[8] != "cid:3" || !slices.Equal(call.run, []uint64{c.id}) {
			t.Fatalf("first handoff: early %v, args %v, run %v; want a plain handoff naming cid:3 next", call.early, call.args, call.run)
		}
		mustPending(t, "b before the reply", b.future)
		h.reply(call, replyInt(3), nil)
		mustGranted(t, "a's unlock", f)
		mustGranted(t, "b", b.future)
		if run := h.lock("L").fairRun; !slices.Equal(run, []uint64{c.id}) {
			t.Fatalf("fairRun %v, want c (%d)", run, c.id)
		}

		call, f = handOff(t, h, 2)
		if !call.early || call.args[7] != "1" || call.args[8] != "" || len(call.args) != 11 || call.args[10] != "0" {
			t.Fatalf("second handoff: early %v, args %v; want early, no next waiter", call.early, call.args)
		}
		if len(c.future.C()) != 1 {
			t.Fatal("c not granted before the reply")
		}
		mustPending(t, "b's unlock before the reply", f)
		h.reply(call, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.FairHandoff)
		want := slices.Clone(call.args)
		want[9] = "1"
		if !retry.retried || !slices.Equal(retry.args, want) {
			t.Fatalf("retry args %v (retried %v), want %v", retry.args, retry.retried, want)
		}
		h.reply(retry, replyInt(2), nil)
		mustGranted(t, "b's unlock", f)
		if hc := h.hold("L", 3); hc == nil || hc.provisional {
			t.Fatalf("c's hold %+v, want confirmed", hc)
		}
		if st := h.m.snapshot(); st.EarlyGrants != 1 || st.Handoffs != 2 {
			t.Errorf("stats %+v, want 2 handoffs, 1 early", st)
		}
	})

	// earlyToC: a hands off to b (reply 3), and b's Unlock hands off early to c.
	earlyToC := func(t *testing.T) (h *mh, c *tw, call scriptCall) {
		h, _, c = setup(t)
		first, _ := handOff(t, h, 1)
		h.reply(first, replyInt(3), nil)
		call, _ = handOff(t, h, 2)
		if !call.early {
			t.Fatal("b's handoff not early")
		}
		return h, c, call
	}

	t.Run("the releasing owner's new Lock waits for the reply", func(t *testing.T) {
		// b's field is on the server until fair_handoff runs: a join of b's that got
		// there first would take it as an unheard grant while c holds.
		h, _, call := earlyToC(t)
		h.acquireFair("L", 2)
		if calls := h.take().calls(scripts.FairAcquire); len(calls) != 0 {
			t.Fatalf("b joined during the early handoff: %v", calls[0].args)
		}
		h.reply(call, replyInt(2), nil)
		join := h.take().one(t, scripts.FairAcquire)
		if join.args[1] != "cid:2" {
			t.Fatalf("join after the reply by %s, want cid:2", join.args[1])
		}
	})

	t.Run("nothing handed over: the receiver leaves the Redis queue", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			reply scripts.Reply
		}{{"nil", scripts.Reply{Nil: true}}, {"0", replyInt(0)}} {
			t.Run(tc.name, func(t *testing.T) {
				h, _, call := earlyToC(t)
				lost := h.hold("L", 3).lostSignal().C()
				h.reply(call, tc.reply, nil)
				mustFired(t, "c's Lost", lost)
				var leave *scriptCall
				for _, l := range h.take().calls(scripts.FairLeave) {
					if l.args[0] == "cid:3" {
						leave = &l
					}
				}
				if leave == nil || leave.args[4] != "1" {
					t.Fatalf("leave for c: %+v; want one that gives back an unheard grant", leave)
				}
			})
		}
	})

	t.Run("reply 2 does not", func(t *testing.T) {
		h, b, _ := setup(t)
		call, _ := handOff(t, h, 1)
		h.reply(call, replyInt(2), nil) // someone else heads the queue now
		mustGranted(t, "b", b.future)
		if run := h.lock("L").fairRun; len(run) != 0 {
			t.Fatalf("fairRun %v after reply 2, want none", run)
		}
		call, _ = handOff(t, h, 2)
		if call.early || call.args[7] != "0" {
			t.Fatalf("handoff after reply 2: early %v, args %v; want a plain one", call.early, call.args)
		}
	})
}

// A hold granted by the retry of an attempt whose reply was lost may have a
// surplus count on the server: the first try may have run, and the retry then
// re-entered it. Its handoff may then not hand over (reply 0), so it grants
// nobody early: an early grant would be lost at once, its Lock having returned
// nil with Lost closing a moment later.
func TestMachineNoEarlyGrantFromMaybeSurplusHold(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn) // ran, reply lost
	h.fire(h.take().retryArmed(t).key)
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil) // the retry re-entered: count 2 on the server
	h.take()
	mustGranted(t, "the retried Lock", w.future)
	next := h.acquire("L", 2, 0, -1)
	h.take()
	c, f := h.unlockCall(t, "L", 1, scripts.LockHandoff)
	if c.early {
		t.Fatal("the handoff from a hold that may have a surplus count granted early")
	}
	mustPending(t, "the next waiter", next.future)
	h.reply(c, replyInt(0), nil) // the surplus kept the lock
	mustGet(t, "unlock", f)
	s := h.take()
	if cs := s.calls(scripts.LockReleaseOwner); len(cs) != 1 || cs[0].args[2] != "0" {
		t.Fatalf("want the surplus released owner-guarded, got %v", s)
	}
	mustPending(t, "the next waiter", next.future)
}

// The other ways a hold may have a surplus count on the server: a re-entry whose
// reply was lost (its waiter given up, or its retry refused), and a give-back of
// one count that failed twice. Each marks the hold, so its handoffs grant nobody
// early.
func TestMachineMaybeSurplusSources(t *testing.T) {
	t.Run("re-entry given up after a lost reply", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		re := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn) // may have run
		h.take()
		h.cancelCtx(re)
		mustGet(t, "the re-entry", re.future)
		if hd := h.hold("L", 1); hd == nil || !hd.maySurplus {
			t.Fatalf("hold %+v, want maySurplus after its re-entry's lost reply", hd)
		}
	})
	t.Run("give-back of one count failed twice", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		re := h.acquire("L", 1, 0, -1) // re-entry whose caller walks away
		att := h.take().one(t, scripts.LockAcquire)
		re.cancel()
		h.m.handle(cancelMsg{id: re.id, err: re.ctx.Err()}, h.now)
		h.reply(att, replyNil, nil) // granted after the cancel: given back
		gb := h.take().one(t, scripts.LockReleaseOwner)
		if len(gb.args) != 4 {
			t.Fatalf("setup: give-back args %q, want a bounded release", gb.args)
		}
		h.reply(gb, scripts.Reply{}, errConn)
		h.reply(h.take().one(t, scripts.LockReleaseOwner), scripts.Reply{}, errConn) // its retry
		if hd := h.hold("L", 1); hd == nil || hd.count != 1 || !hd.maySurplus {
			t.Fatalf("hold %+v, want count 1 and maySurplus", hd)
		}
	})
}
