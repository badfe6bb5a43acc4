package engine

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/futures"
	"github.com/leash-go/leash/internal/scripts"
)

// fairRelaySetup: owner 1 holds fair lock L; owners 2 to 5 queue behind it in
// Redis, in that order. Owner 1 hands off to owner 2 (a plain handoff, whose reply
// says owners 3, 4 and 5 are next); owner 2's Unlock hands off early to owner 3,
// and owners 3 and 4 unlock while that handoff is in flight: owners 4 and 5 are
// relayed on with no call. It returns the early handoff and owners 3's and 4's
// Unlocks. With more, owners 6 and on queue too, behind owner 5.
func fairRelaySetup(t *testing.T, more ...uint64) (h *mh, c scriptCall, ws map[uint64]*tw, unlocks []*futures.Future[error]) {
	t.Helper()
	h = newMH(t)
	ws = map[uint64]*tw{1: h.acquireFair("L", 1)}
	h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
	h.take()
	for _, owner := range append([]uint64{2, 3, 4, 5}, more...) {
		ws[owner] = h.acquireFair("L", owner)
		h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
		h.take()
	}
	h.unlock("L", 1)
	first := h.take().one(t, scripts.FairHandoff)
	want := []string{"cid:3", "0", "0", "cid:4", "cid:5"}
	for _, owner := range more {
		want = append(want, ownerField("cid", owner))
	}
	if first.early || !slices.Equal(first.args[8:], want) {
		t.Fatalf("first handoff: early %v, args %v; want a plain one with the run %v", first.early, first.args, want)
	}
	h.reply(first, replyInt(int64(2+3+len(more))), nil) // owners 3 and on head the queue now
	mustGranted(t, "owner 2", ws[2].future)
	if run := h.lock("L").fairRun; len(run) != 3+len(more) || run[0] != ws[3].id || run[2] != ws[5].id {
		t.Fatalf("fairRun %v, want owners 3 and on", run)
	}

	h.unlock("L", 2)
	c = h.take().one(t, scripts.FairHandoff)
	if !c.early || c.args[2] != "cid:3" {
		t.Fatalf("owner 2's handoff: early %v, args %v; want early to cid:3", c.early, c.args)
	}
	mustGranted(t, "owner 3", ws[3].future)
	for _, owner := range []uint64{3, 4} {
		unlocks = append(unlocks, h.unlock("L", owner))
		h.take().none(t) // relayed: no call of its own
	}
	mustGranted(t, "owner 4, relayed", ws[4].future)
	mustGranted(t, "owner 5, relayed", ws[5].future)
	for _, f := range unlocks {
		mustPending(t, "relayed Unlock before the reply", f)
	}
	if st := h.m.snapshot(); st.Relays != 2 || st.EarlyGrants != 3 {
		t.Fatalf("stats %+v, want 2 relays and 3 early grants", st)
	}
	return h, c, ws, unlocks
}

// busy reports whether owner of lock L has a call in flight (its calls wait).
func (h *mh) busy(owner uint64) bool { return h.m.ownerBusy(holdKey{h.lockID("L"), owner}) }

// leavesOf returns the fields that s's fair_leave calls take out of the queue.
func leavesOf(s step) []string {
	var out []string
	for _, c := range s.calls(scripts.FairLeave) {
		out = append(out, c.args[0])
	}
	slices.Sort(out)
	return out
}

// The fair relay (fairrun.go): holders that the last reply's run says are next in
// the Redis queue are granted with no call while an early handoff is in flight;
// one follow-up moves the lock to the last of them and takes the ones in between
// out of the queue.
func TestMachineFairRelay(t *testing.T) {
	t.Run("handed over: one follow-up names the relayed", func(t *testing.T) {
		h, c, _, unlocks := fairRelaySetup(t)
		h.reply(c, replyInt(2+2), nil) // owners 4 and 5 head the queue now
		fu := h.take().one(t, scripts.FairHandoff)
		lease, wait := c.args[3], c.args[4] // owner 3's lease, the fair wait
		if want := []string{"cid:3", lease, "cid:5", lease, wait, wallMillis(h.now), "0", "1", "", "0", "1", "cid:4"}; !slices.Equal(fu.args, want) {
			t.Fatalf("follow-up args %v, want %v", fu.args, want)
		}
		if !fu.early || fu.relayed == nil || fu.owner != 3 || fu.receiver != 5 {
			t.Fatalf("follow-up: early %v, relayed %v, owner %d, receiver %d", fu.early, fu.relayed != nil, fu.owner, fu.receiver)
		}
		for _, f := range unlocks {
			mustPending(t, "relayed Unlock before the follow-up's reply", f)
		}
		if !h.busy(3) || !h.busy(4) || !h.busy(5) {
			t.Fatalf("owners 3, 4, 5 busy: %v %v %v; want all until the follow-up's reply", h.busy(3), h.busy(4), h.busy(5))
		}
		h.reply(fu, replyInt(2), nil)
		for _, f := range unlocks {
			mustGranted(t, "relayed Unlock", f)
		}
		if h.busy(3) || h.busy(4) || h.busy(5) {
			t.Fatal("an owner still busy after the follow-up's reply")
		}
		if hd := h.hold("L", 5); hd == nil || hd.provisional {
			t.Fatalf("the tail's hold %+v, want confirmed", hd)
		}
		if st := h.m.snapshot(); st.ScriptCalls != 5+3 {
			t.Errorf("script calls %d, want 8 (5 joins, 3 handoffs for 4 handoffs)", st.ScriptCalls)
		}
		h.take().none(t)
	})

	t.Run("an owner in between joins again after the follow-up", func(t *testing.T) {
		// Its old entry is in the queue until the follow-up runs, under the same
		// field its new join would take.
		h, c, _, _ := fairRelaySetup(t)
		again := h.acquireFair("L", 4)
		h.take().none(t)
		h.reply(c, replyInt(2+2), nil)
		fu := h.take().one(t, scripts.FairHandoff)
		h.take().none(t)
		h.reply(fu, replyInt(2), nil)
		join := h.take().one(t, scripts.FairAcquire)
		if join.args[1] != "cid:4" || join.args[4] != "0" {
			t.Fatalf("join %v, want cid:4's, a plain one", join.args)
		}
		mustPending(t, "owner 4 again", again.future)
	})

	t.Run("the tail relays on during the follow-up, down the run after it", func(t *testing.T) {
		h, c, ws, _ := fairRelaySetup(t, 6, 7)
		h.reply(c, replyInt(2+4), nil) // owners 4 to 7 head the queue now
		if run := h.lock("L").fairRun; !slices.Equal(run, []uint64{ws[6].id, ws[7].id}) {
			t.Fatalf("fairRun %v, want owners 6 and 7 (4 and 5 relayed)", run)
		}
		fu := h.take().one(t, scripts.FairHandoff)
		if fu.args[8] != "cid:6" || !slices.Equal(fu.args[10:], []string{"1", "cid:4", "cid:7"}) {
			t.Fatalf("follow-up args %v; want the run cid:6, cid:7 and cid:4 relayed", fu.args)
		}
		f5 := h.unlock("L", 5)
		h.take().none(t)
		mustGranted(t, "owner 6, relayed during the follow-up", ws[6].future)
		h.reply(fu, replyInt(2+2), nil)
		fu2 := h.take().one(t, scripts.FairHandoff)
		if fu2.args[0] != "cid:5" || fu2.args[2] != "cid:6" || fu2.args[10] != "0" {
			t.Fatalf("second follow-up args %v, want cid:5 to cid:6, nobody in between", fu2.args)
		}
		mustPending(t, "owner 5's Unlock before the second follow-up's reply", f5)
		h.reply(fu2, replyInt(2+1), nil)
		mustGranted(t, "owner 5's Unlock", f5)
		if run := h.lock("L").fairRun; !slices.Equal(run, []uint64{ws[7].id}) {
			t.Fatalf("fairRun %v, want owner 7", run)
		}
	})

	t.Run("a join while an early handoff is in flight is join-only", func(t *testing.T) {
		h, c, _, _ := fairRelaySetup(t)
		h.acquireFair("L", 6)
		join := h.take().one(t, scripts.FairAcquire)
		if join.args[1] != "cid:6" || join.args[4] != "2" {
			t.Fatalf("join %v during the handoff; want cid:6's, join-only (ARGV[5] 2)", join.args)
		}
		h.reply(join, replyPTTL(5*time.Second), nil)
		h.reply(c, replyInt(2+2), nil)
		fu := h.take().one(t, scripts.FairHandoff)
		if got := fu.args[12:]; !slices.Equal(got, []string{}) || fu.args[8] != "cid:6" {
			t.Fatalf("follow-up args %v, want the run to start at cid:6", fu.args)
		}
	})

	t.Run("the run is all a relay may grant", func(t *testing.T) {
		h, c, _, _ := fairRelaySetup(t)
		h.reply(c, replyInt(2+1), nil) // only owner 4 known to head the queue: not as far as the tail
		fu := h.take().one(t, scripts.FairHandoff)
		w6 := h.acquireFair("L", 6)
		h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(5*time.Second), nil)
		h.take()
		if run := h.lock("L").fairRun; len(run) != 0 {
			t.Fatalf("fairRun %v, want none (the reply did not reach the relay's tail)", run)
		}
		f5 := h.unlock("L", 5)
		h.take().none(t) // waits for the follow-up: not relayed to owner 6
		mustPending(t, "owner 6", w6.future)
		h.reply(fu, replyInt(2), nil)
		hand := h.take().one(t, scripts.FairHandoff)
		if hand.early || hand.args[2] != "cid:6" {
			t.Fatalf("owner 5's handoff: early %v, args %v; want a plain one to cid:6", hand.early, hand.args)
		}
		h.reply(hand, replyInt(2), nil)
		mustGranted(t, "owner 5's Unlock", f5)
		mustGranted(t, "owner 6", w6.future)
	})

	t.Run("not handed over (reply nil): the relayed and the tail leave", func(t *testing.T) {
		h, c, _, unlocks := fairRelaySetup(t, 6)
		lost5 := h.hold("L", 5).lostSignal().C()
		h.reply(c, replyNil, nil)
		for _, f := range unlocks {
			if err := mustGet(t, "relayed Unlock", f); !errors.Is(err, ErrLockLost) {
				t.Fatalf("relayed Unlock = %v, want ErrLockLost", err)
			}
		}
		mustFired(t, "the tail's Lost", lost5)
		if run := h.lock("L").fairRun; len(run) != 0 {
			t.Fatalf("fairRun %v after nothing was handed over, want none", run)
		}
		s := h.take()
		if got, want := leavesOf(s), []string{"cid:3", "cid:4", "cid:5"}; !slices.Equal(got, want) {
			t.Fatalf("leaves %v, want %v", got, want)
		}
		if len(s.calls(scripts.FairHandoff)) != 0 {
			t.Fatal("a follow-up after nothing was handed over")
		}
		for _, owner := range []uint64{4, 5} {
			if h.hold("L", owner) != nil {
				t.Fatalf("owner %d still holds", owner)
			}
		}
	})

	t.Run("the follow-up finds the receiver's field gone: the relayed in between leave", func(t *testing.T) {
		// A force-release took the lock, and a release that found it free may have
		// granted owner 4, still at the queue's head, directly: its leave gives
		// such a grant back.
		h, c, _, unlocks := fairRelaySetup(t)
		h.reply(c, replyInt(2+2), nil)
		fu := h.take().one(t, scripts.FairHandoff)
		h.reply(fu, replyNil, nil)
		for _, f := range unlocks {
			if err := mustGet(t, "relayed Unlock", f); !errors.Is(err, ErrLockLost) {
				t.Fatalf("relayed Unlock = %v, want ErrLockLost", err)
			}
		}
		var leave4 *scriptCall
		s := h.take()
		for _, l := range s.calls(scripts.FairLeave) {
			if l.args[0] == "cid:4" {
				leave4 = &l
			}
		}
		if leave4 == nil || leave4.args[4] != "1" {
			t.Fatalf("leaves %v; want cid:4's, giving back a grant it did not hear of", leavesOf(s))
		}
		if h.busy(4) {
			t.Fatal("owner 4 still busy")
		}
	})

	t.Run("the owners in between are freed after the next follow-up is sent", func(t *testing.T) {
		h, c, _, _ := fairRelaySetup(t, 6, 7)
		h.reply(c, replyInt(2+4), nil)
		fu := h.take().one(t, scripts.FairHandoff)
		h.acquireFair("L", 4) // owner 4 was relayed on in between: its Lock waits
		h.unlock("L", 5)      // relayed to owner 6 during the follow-up
		h.take().none(t)
		h.reply(fu, replyInt(2+2), nil)
		s := h.take()
		iHand, iJoin := -1, -1
		for i, call := range s.scripts {
			switch {
			case call.script == scripts.FairHandoff && iHand < 0:
				iHand = i
			case call.script == scripts.FairAcquire && call.args[1] == "cid:4":
				iJoin = i
				if call.args[4] != "2" {
					t.Errorf("owner 4's join %v while the next follow-up is in flight; want join-only", call.args)
				}
			}
		}
		if iHand < 0 || iJoin < 0 || iJoin < iHand {
			t.Fatalf("calls %v; want the next follow-up, then owner 4's join", s)
		}
		// Owner 6 unlocks during that follow-up: owner 7 is next in the run.
		h.unlock("L", 6)
		h.take().none(t)
		if h.hold("L", 7) == nil {
			t.Fatal("owner 7 not relayed to")
		}
	})

	t.Run("the follow-up fails twice: the relayed in between leave", func(t *testing.T) {
		h, c, _, unlocks := fairRelaySetup(t)
		h.reply(c, replyInt(2+2), nil)
		fu := h.take().one(t, scripts.FairHandoff)
		h.reply(fu, scripts.Reply{}, errConn)
		retry := h.take().one(t, scripts.FairHandoff)
		want := slices.Clone(fu.args)
		want[9] = "1"
		if !retry.retried || !slices.Equal(retry.args, want) {
			t.Fatalf("retry args %v, want %v (the relayed list kept)", retry.args, want)
		}
		h.reply(retry, scripts.Reply{}, errConn)
		for _, f := range unlocks {
			if err := mustGet(t, "relayed Unlock", f); !errors.Is(err, errConn) {
				t.Fatalf("relayed Unlock = %v, want the transport error", err)
			}
		}
		if got := leavesOf(h.take()); !slices.Contains(got, "cid:4") || !slices.Contains(got, "cid:5") {
			t.Fatalf("leaves %v, want cid:4's and cid:5's", got)
		}
		if h.busy(4) {
			t.Fatal("owner 4 still busy")
		}
	})
}

// A plain fair handoff that fails does not mark its waiter registered for the
// reentrant lock's direct grants, whose leave (lock_leave) a fair lock never runs.
func TestMachineFairHandoffFailureNoRegistration(t *testing.T) {
	h := newMH(t)
	h.acquireFair("L", 1)
	h.reply(h.take().one(t, scripts.FairAcquire), replyNil, nil)
	h.take()
	w := h.acquireFair("L", 2)
	h.reply(h.take().one(t, scripts.FairAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	h.unlock("L", 1)
	call := h.take().one(t, scripts.FairHandoff)
	if call.early {
		t.Fatal("the first handoff is early")
	}
	h.reply(call, scripts.Reply{}, errConn)
	h.take()
	h.cancelCtx(w)
	if got := h.take().calls(scripts.LockLeave); len(got) != 0 {
		t.Fatalf("lock_leave on a fair lock: %v", got[0].args)
	}
}
