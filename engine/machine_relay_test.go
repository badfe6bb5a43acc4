package engine

import (
	"errors"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// relaySetup: owner 1 holds L, owners 2, 3 and 4 wait, owner 1 unlocks (an early
// handoff to owner 2 goes out), and owners 2 and 3 unlock while it is in flight.
// It returns the handoff call, the waiters, and owners 2's and 3's Unlocks.
func relaySetup(t *testing.T) (h *mh, c scriptCall, ws []*tw, unlocks []*futures.Future[error]) {
	t.Helper()
	h = newMH(t)
	a := h.grantFresh("L", 1, 0)
	for owner := uint64(2); owner <= 4; owner++ {
		ws = append(ws, h.acquire("L", owner, 5*time.Second, -1))
	}
	h.take()
	h.unlock("L", a.owner)
	c = h.take().one(t, scripts.LockHandoff)
	mustGranted(t, "owner 2", ws[0].future)
	for _, owner := range []uint64{2, 3} {
		unlocks = append(unlocks, h.unlock("L", owner))
		h.take().none(t) // relayed: no call of its own
	}
	mustGranted(t, "owner 3, relayed", ws[1].future)
	mustGranted(t, "owner 4, relayed", ws[2].future)
	for i, f := range unlocks {
		mustPending(t, "relayed Unlock "+strconv.Itoa(i+2)+" before the reply", f)
	}
	if hd := h.hold("L", 4); hd == nil || !hd.provisional || h.hold("L", 2) != nil || h.hold("L", 3) != nil {
		t.Fatalf("holds 2, 3, 4: %v, %v, %+v; want only a provisional 4", h.hold("L", 2), h.hold("L", 3), hd)
	}
	if st := h.m.snapshot(); st.Relays != 2 || st.EarlyGrants != 3 {
		t.Fatalf("stats %+v, want 2 relays and 3 early grants", st)
	}
	return h, c, ws, unlocks
}

// The relay (relay.go): holders that come and go while an early handoff is in
// flight make no call; the reply answers their Unlocks, and one follow-up moves
// the lock from the handoff's receiver to the last of them.
func TestMachineRelay(t *testing.T) {
	t.Run("handed over: one follow-up to the tail", func(t *testing.T) {
		h, c, _, unlocks := relaySetup(t)
		h.reply(c, replyInt(2), nil)
		for _, f := range unlocks {
			mustPending(t, "relayed Unlock before the follow-up's reply", f)
		}
		fu := h.take().one(t, scripts.LockHandoff)
		if want := []string{"cid:2", "5000", "cid:4", "5000", "0", "0", "0", "cid", "0", "", "4"}; !slices.Equal(fu.args, want) {
			t.Fatalf("follow-up args %v, want %v", fu.args, want)
		}
		if !fu.early || fu.unlock != nil || fu.owner != 2 || fu.receiver != 4 {
			t.Fatalf("follow-up: early %v, unlock %v, owner %d, receiver %d", fu.early, fu.unlock, fu.owner, fu.receiver)
		}
		sent := h.now
		h.now = h.now.Add(time.Millisecond)
		h.replyAt(fu, sent, replyInt(2), nil)
		for _, f := range unlocks {
			mustGranted(t, "relayed Unlock", f)
		}
		hd := h.hold("L", 4)
		if hd == nil || hd.provisional || !hd.expiresAt.Equal(sent.Add(5*time.Second)) {
			t.Fatalf("tail's hold %+v; want confirmed, its lease from the follow-up's send", hd)
		}
		if st := h.m.snapshot(); st.Handoffs != 2 || st.ScriptCalls != 3 {
			t.Errorf("stats %+v; want 2 handoff calls (3 holders moved) and 3 script calls", st)
		}
		h.take().none(t)
	})

	t.Run("the receiver's calls wait for the follow-up", func(t *testing.T) {
		// Owner 2's field is on the server until the follow-up runs: a Lock of
		// owner 2's sent meanwhile would re-enter it, beside owner 4's hold.
		h, c, _, _ := relaySetup(t)
		again := h.acquire("L", 2, 5*time.Second, -1)
		h.reply(c, replyInt(2), nil)
		fu := h.take().one(t, scripts.LockHandoff)
		if h.m.ownerBusy(holdKey{h.lockID("L"), 3}) {
			t.Error("owner 3 (relayed on in between) still busy after the reply")
		}
		h.take().none(t)
		h.reply(fu, replyInt(2), nil)
		mustPending(t, "owner 2's Lock while owner 4 holds", again.future)
		h.take().none(t) // it waits for owner 4's release, parked
		f4 := h.unlock("L", 4)
		next := h.take().one(t, scripts.LockHandoff)
		if next.args[0] != "cid:4" || next.args[2] != "cid:2" {
			t.Fatalf("handoff args %v, want cid:4 to cid:2", next.args)
		}
		mustGranted(t, "owner 2 again", again.future)
		h.reply(next, replyInt(2), nil)
		mustGranted(t, "owner 4's Unlock", f4)
	})

	t.Run("the tail relays on during the follow-up", func(t *testing.T) {
		h, c, _, _ := relaySetup(t)
		w5 := h.acquire("L", 5, 5*time.Second, -1)
		h.reply(c, replyInt(2), nil)
		fu := h.take().one(t, scripts.LockHandoff)
		f4 := h.unlock("L", 4)
		h.take().none(t)
		mustGranted(t, "owner 5, relayed during the follow-up", w5.future)
		h.reply(fu, replyInt(2), nil)
		fu2 := h.take().one(t, scripts.LockHandoff)
		if fu2.args[0] != "cid:4" || fu2.args[2] != "cid:5" {
			t.Fatalf("second follow-up args %v, want cid:4 to cid:5", fu2.args)
		}
		mustPending(t, "owner 4's Unlock before the second follow-up's reply", f4)
		h.reply(fu2, replyInt(2), nil)
		mustGranted(t, "owner 4's Unlock", f4)
	})

	t.Run("not handed over (reply nil): the relayed holds were never real", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 5*time.Second, -1)
		h.acquire("L", 3, 5*time.Second, -1)
		h.take()
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		lost2 := h.hold("L", 2).lostSignal().C()
		f2 := h.unlock("L", 2)
		lost3 := h.hold("L", 3).lostSignal().C()
		h.reply(c, replyNil, nil)
		if err := mustGet(t, "relayed Unlock", f2); !errors.Is(err, ErrLockLost) {
			t.Fatalf("relayed Unlock = %v, want ErrLockLost", err)
		}
		mustFired(t, "owner 2's Lost", lost2)
		mustFired(t, "the tail's Lost", lost3)
		if h.hold("L", 3) != nil {
			t.Fatal("the tail's hold kept")
		}
		h.take().none(t) // nothing of owners 2's or 3's is on the server
		if h.m.ownerBusy(holdKey{h.lockID("L"), 2}) || h.m.ownerBusy(holdKey{h.lockID("L"), 3}) {
			t.Error("an owner still busy")
		}
	})

	t.Run("transport error twice: the receiver's field goes too", func(t *testing.T) {
		h, c, _, unlocks := relaySetup(t)
		h.reply(c, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.LockHandoff)
		h.reply(retry, scripts.Reply{}, errConn)
		for _, f := range unlocks {
			if err := mustGet(t, "relayed Unlock", f); !errors.Is(err, errConn) {
				t.Fatalf("relayed Unlock = %v, want the transport error", err)
			}
		}
		var got []string
		for _, r := range h.take().calls(scripts.LockReleaseOwner) {
			got = append(got, r.args[1]+"/"+r.args[2])
		}
		slices.Sort(got)
		if want := []string{"cid:1/0", "cid:2/0"}; !slices.Equal(got, want) {
			t.Fatalf("owner-guarded releases %v, want %v", got, want)
		}
		if h.hold("L", 4) != nil {
			t.Fatal("the tail's hold kept")
		}
	})

	for _, found := range []bool{true, false} {
		t.Run("the tail's hold ended: the receiver's field is released, found "+strconv.FormatBool(found), func(t *testing.T) {
			h, c, _, unlocks := relaySetup(t)
			hd := h.hold("L", 4)
			h.now = hd.expiresAt
			h.fire(timer.Key{Kind: kindExpiry, ID: hd.id}) // the reply is late
			h.take().none(t)
			h.reply(c, replyInt(2), nil)
			var got []string
			var release scriptCall
			for _, r := range h.take().calls(scripts.LockReleaseOwner) {
				got = append(got, r.args[1])
				if r.args[1] == "cid:2" {
					release = r
				}
			}
			slices.Sort(got)
			if want := []string{"cid:2", "cid:4"}; !slices.Equal(got, want) {
				t.Fatalf("owner-guarded releases of %v, want %v (no follow-up)", got, want)
			}
			for _, f := range unlocks {
				mustPending(t, "relayed Unlock before the release's reply", f)
			}
			// The release finds the receiver's field (1: deleted), or not (-1: a
			// force-release took it meanwhile, so the relayed holds were lost).
			if found {
				h.reply(release, replyInt(1), nil)
			} else {
				h.reply(release, replyInt(-1), nil)
			}
			for _, f := range unlocks {
				if err := mustGet(t, "relayed Unlock", f); found != (err == nil) || !found && !errors.Is(err, ErrLockLost) {
					t.Fatalf("relayed Unlock = %v with the field found %v", err, found)
				}
			}
		})
	}

	t.Run("the chain bound stops the relay", func(t *testing.T) {
		h := newMH(t, func(c *config) { c.handoffChain = 2 })
		a := h.grantFresh("L", 1, 0)
		for owner := uint64(2); owner <= 4; owner++ {
			h.acquire("L", owner, 5*time.Second, -1)
		}
		h.take()
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		f2 := h.unlock("L", 2) // relayed: the chain's second handoff
		f3 := h.unlock("L", 3) // the bound: it waits for the reply
		h.take().none(t)
		h.reply(c, replyInt(5), nil)               // handed over; another process listens
		fu := h.take().one(t, scripts.LockHandoff) // the follow-up to owner 3
		mustPending(t, "owner 3's Unlock at the bound", f3)
		h.reply(fu, replyInt(2), nil)
		mustGranted(t, "owner 2's Unlock", f2)
		bounded := h.take().one(t, scripts.LockHandoff)
		if bounded.args[0] != "cid:3" || bounded.args[4] != "1" || bounded.early {
			t.Fatalf("handoff at the bound: args %v, early %v", bounded.args, bounded.early)
		}
	})
}

// Relays against the in-memory model of the scripts: after any mix of relays,
// follow-ups and a force-release, the engine's holds and Redis's agree.
func TestMachineRelayAgainstModel(t *testing.T) {
	for _, force := range []bool{false, true} {
		t.Run("force "+strconv.FormatBool(force), func(t *testing.T) {
			h := newMH(t)
			r := newMemRedis()
			a := h.grantFresh("L", 1, 0)
			r.set("L", "cid:1", 1, 30*time.Second)
			var ws []*tw
			for owner := uint64(2); owner <= 9; owner++ {
				ws = append(ws, h.acquire("L", owner, 5*time.Second, -1))
			}
			h.take()
			h.unlock("L", a.owner)
			pending := h.take().scripts
			for owner := uint64(2); owner <= 9; owner++ {
				// Every holder unlocks as soon as it holds; calls run one step late.
				if owner == 6 && force {
					h.m.handle(forceUnlockMsg{lock: "L", future: futures.New[forceResult]()}, h.now)
				}
				for h.hold("L", owner) == nil && len(pending) > 0 {
					pending = modelRound(h, r, pending)
				}
				if h.hold("L", owner) != nil {
					h.unlock("L", owner)
					pending = append(pending, h.take().scripts...)
				}
			}
			for range 20 {
				pending = modelRound(h, r, pending)
			}
			for owner := uint64(1); owner <= 9; owner++ {
				hd := h.hold("L", owner)
				n := r.holders("L")["cid:"+strconv.FormatUint(owner, 10)]
				if (hd == nil && n != 0) || (hd != nil && int64(hd.count) != n) {
					t.Errorf("owner %d: engine %+v, Redis %d", owner, hd, n)
				}
			}
			if len(h.m.serial) != 0 {
				t.Errorf("owners still busy: %v", h.m.serial)
			}
			if st := h.m.snapshot(); st.Relays == 0 {
				t.Errorf("no relays: %+v", st)
			} else {
				t.Logf("stats %+v", st)
			}
		})
	}
}

// Review findings: what a relay must not do.
func TestMachineRelayRefusals(t *testing.T) {
	t.Run("no relay to an owner giving back", func(t *testing.T) {
		// Owner 5's failed TryLock left a give-back of its field in flight; a
		// relayed grant's follow-up could write that field just before the
		// give-back's retry deletes it.
		h := newMH(t)
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 5*time.Second, -1)
		h.take()
		try := h.acquire("L", 5, 5*time.Second, 0)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
		if err := mustGet(t, "TryLock", try.future); err == nil {
			t.Fatal("TryLock granted")
		}
		h.take().one(t, scripts.LockReleaseOwner) // the give-back
		w5 := h.acquire("L", 5, 5*time.Second, -1)
		h.take()
		h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		f2 := h.unlock("L", 2)
		h.take().none(t)
		mustPending(t, "owner 5 (giving back)", w5.future)
		h.reply(c, replyInt(2), nil)
		mustPending(t, "owner 2's Unlock, not relayed", f2)
		if st := h.m.snapshot(); st.Relays != 0 {
			t.Fatalf("%d relays, want none", st.Relays)
		}
	})

	t.Run("no relay to a waiter registered for direct grants", func(t *testing.T) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 5*time.Second, -1)
		w3 := h.acquire("L", 3, 5*time.Second, -1)
		h.take()
		h.m.waiters[w3.id].registered = true
		h.unlock("L", a.owner)
		h.take().one(t, scripts.LockHandoff)
		h.unlock("L", 2)
		h.take().none(t)
		mustPending(t, "owner 3 (registered)", w3.future)
	})
}

// A force-release that deletes the receiver's field after the handoff ran but
// before the relayed holds end: their Unlocks report the loss, and their Lost
// signals close, in either order of the replies.
func TestMachineRelayForceReleased(t *testing.T) {
	for _, forceReplyFirst := range []bool{true, false} {
		t.Run("force reply first "+strconv.FormatBool(forceReplyFirst), func(t *testing.T) {
			h := newMH(t)
			r := newMemRedis()
			a := h.grantFresh("L", 1, 0)
			r.set("L", "cid:1", 1, 30*time.Second)
			for owner := uint64(2); owner <= 4; owner++ {
				h.acquire("L", owner, 5*time.Second, -1)
			}
			h.take()
			h.unlock("L", a.owner)
			c := h.take().one(t, scripts.LockHandoff)
			lost2 := h.hold("L", 2).lostSignal().C()
			repC := modelRun(r, c) // on the server: the handoff, then the force-release
			h.m.handle(forceUnlockMsg{lock: "L", future: futures.New[forceResult]()}, h.now)
			fc := h.take().one(t, scripts.LockForceRelease)
			forceSent := h.now
			repF := modelRun(r, fc)
			h.now = h.now.Add(time.Millisecond)
			f2, f3 := h.unlock("L", 2), h.unlock("L", 3)
			var pending []scriptCall
			if forceReplyFirst {
				h.replyAt(fc, forceSent, repF, nil)
				pending = append(pending, h.take().scripts...)
			}
			h.reply(c, repC, nil)
			pending = append(pending, h.take().scripts...)
			if !forceReplyFirst {
				h.replyAt(fc, forceSent, repF, nil)
				pending = append(pending, h.take().scripts...)
			}
			for range 5 {
				pending = modelRound(h, r, pending)
			}
			for i, f := range []*futures.Future[error]{f2, f3} {
				if err := mustGet(t, "relayed Unlock", f); !errors.Is(err, ErrLockLost) {
					t.Errorf("owner %d's Unlock = %v, want ErrLockLost", i+2, err)
				}
			}
			mustFired(t, "owner 2's Lost", lost2)
			if hd := h.hold("L", 4); hd != nil {
				t.Errorf("the tail still holds: %+v", hd)
			}
		})
	}
}

// modelRun runs one call on the in-memory model of the scripts.
func modelRun(r *memRedis, c scriptCall) scripts.Reply {
	var pub [][2]string
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.run(c.script, c.keys, c.args, &pub)
}

// modelRound runs the calls in order on the model, replies to each, and returns
// the calls the replies made.
func modelRound(h *mh, r *memRedis, calls []scriptCall) []scriptCall {
	var next []scriptCall
	for _, c := range calls {
		h.reply(c, modelRun(r, c), nil)
		next = append(next, h.take().scripts...)
	}
	return next
}
