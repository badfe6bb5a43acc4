package engine

import (
	"fmt"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// Direct grants of the reentrant lock (directgrant.go), on the machine alone.

// withGrants is a machine whose grant channel is subscribed, so queued attempts
// register.
func withGrants(t *testing.T) *mh {
	h := newMH(t)
	h.m.grantSub = subSubscribed
	return h
}

// registeredWaiter queues a waiter of owner on lock, refused once and then
// registered by its second attempt (woken by its subscription), which is refused
// too; it returns the waiter and that attempt.
func (h *mh) registeredWaiter(t *testing.T, lock string, owner uint64) (*tw, scriptCall) {
	t.Helper()
	w := h.acquire(lock, owner, 0, -1)
	first := h.take().one(t, scripts.LockAcquire)
	if len(first.args) != 2 || len(first.keys) != 1 {
		t.Fatalf("first attempt keys %q args %q, want no registration", first.keys, first.args)
	}
	h.reply(first, replyPTTL(30*time.Second), nil)
	h.take()
	h.subscribed(lock) // a client registers once it listens on the unlock channel
	att := h.take().one(t, scripts.LockAcquire)
	if len(att.args) != 5 || att.args[2] != "cid" || att.args[4] != h.m.grantFieldOf(w.id) {
		t.Fatalf("second attempt args %q, want a registration and the waiter's grant field", att.args)
	}
	return w, att
}

// grantMessage delivers the grant message of waiter w on lock, with stamp 0.
func (h *mh) grantMessage(w *tw) {
	h.m.handle(unlockNotice{channel: h.m.grantChannel, payload: fmt.Sprintf("%d|0|%s", w.id, w.lock)}, h.now)
}

var replyClaimed = scripts.Reply{Int: -3}

// registeredLeaves queues a registered waiter w of owner 1 on "L" and a waiter
// next of owner 2 behind it, then cancels w; it returns them and w's lock_leave.
func (h *mh) registeredLeaves(t *testing.T) (w, next *tw, leave scriptCall) {
	t.Helper()
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	next = h.acquire("L", 2, 0, -1)
	h.take().none(t)
	h.cancelCtx(w)
	return w, next, h.take().one(t, scripts.LockLeave)
}

// heldByGrant makes owner hold lock by a direct grant taken from its message; the
// effects are consumed up to the grant, which made none.
func (h *mh) heldByGrant(t *testing.T, lock string, owner uint64) *tw {
	t.Helper()
	w, att := h.registeredWaiter(t, lock, owner)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.grantMessage(w)
	h.take().none(t)
	mustGranted(t, "grant by message", w.future)
	return w
}

// A registered waiter takes a grant from its message, under its grant field, with
// no call of its own; its handle's calls then use that field.
func TestMachineDirectGrantByMessage(t *testing.T) {
	h := withGrants(t)
	w := h.heldByGrant(t, "L", 1)
	if f := h.hold("L", 1).field; f != h.m.grantFieldOf(w.id) {
		t.Fatalf("hold field %q, want the grant's", f)
	}
	c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
	if c.args[2] != h.m.grantFieldOf(w.id) {
		t.Fatalf("release of field %q, want the grant's", c.args[2])
	}
}

// A grant claimed by the waiter's attempt before its message came: the message,
// arriving after the hold was handed on early, gives nothing back (the field is
// the handoff's to swap; a give-back racing it would delete the new holder's lock).
func TestMachineDirectGrantClaimedThenMessage(t *testing.T) {
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyClaimed, nil)
	mustGranted(t, "claimed grant", w.future)
	h.take()
	w2 := h.acquire("L", 2, 0, -1)
	h.take()
	c, _ := h.unlockCall(t, "L", 1, scripts.LockHandoff)
	if !c.early {
		t.Fatalf("the handoff to the local waiter did not grant early")
	}
	mustGranted(t, "early grant", w2.future)
	h.grantMessage(w)
	h.take().none(t)
}

// A grant to a waiter that left goes back by its grant field; a waiter that gives
// up leaves its registration (lock_leave), and the next waiter registers in its
// place in the same call.
func TestMachineDirectGrantLeave(t *testing.T) {
	h := withGrants(t)
	w, next, leave := h.registeredLeaves(t)
	if leave.args[1] != fmt.Sprint(w.id) || leave.args[2] != h.m.grantFieldOf(w.id) || leave.args[5] == "" {
		t.Fatalf("leave args %q, want w's id and field and the next waiter's registration", leave.args)
	}
	h.reply(leave, scripts.Reply{Int: 0}, nil)
	h.grantMessage(w) // a grant made before the leave ran
	back := h.take().one(t, scripts.LockLeave)
	if back.args[2] != h.m.grantFieldOf(w.id) {
		t.Fatalf("give-back of field %q, want w's grant field", back.args[2])
	}
	h.reply(back, scripts.Reply{Int: 1}, nil)
	h.grantMessage(next) // the next waiter, registered by the leave
	mustGranted(t, "grant to the waiter registered by the leave", next.future)
}

// A re-entry under a direct grant's field whose hold ends while the attempt is in
// flight, answered by a transport error: the field may hold the lock for nobody,
// so it is released before the waiter retries under its handle's field.
func TestMachineDirectGrantReentryFieldCleanedUp(t *testing.T) {
	h := withGrants(t)
	w := h.heldByGrant(t, "L", 1)
	field := h.m.grantFieldOf(w.id)
	h.acquire("L", 1, 0, -1) // a re-entry
	re := h.take().one(t, scripts.LockAcquire)
	if re.args[1] != field {
		t.Fatalf("re-entry names %q, want the grant's field %q", re.args[1], field)
	}
	h.m.loseHold(h.hold("L", 1), false)
	h.take()
	h.reply(re, scripts.Reply{}, errConn)
	c := h.take().one(t, scripts.LockReleaseOwner)
	if c.args[1] != field || c.args[2] != "0" {
		t.Fatalf("cleanup args %q, want all of the grant's field %q", c.args, field)
	}
}

// A subscription that was not confirmed leaves the lock unsubscribed, with a retry
// soon: a release that finds nobody listening publishes nothing.
func TestMachineSubscribeErrorRetries(t *testing.T) {
	h := withGrants(t)
	h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.m.handle(subscribeDone{lock: h.lockID("L"), err: errConn}, h.now)
	if l := h.lock("L"); l.sub != subNone {
		t.Fatalf("subscription state %v after an error, want none", l.sub)
	}
	if armed := h.take().armed(kindRetry); len(armed) != 1 || armed[0].d != subscribeRetry {
		t.Fatalf("retry timers %+v, want one in %v", armed, subscribeRetry)
	}
}

// A Subscribe that failed leaves its channel with the registry, which subscribes
// it on its next connection (pubsub.Registry.Subscribe): when the lock's waiters
// are done before a subscribe succeeds, the lock unsubscribes all the same, and
// its state is not forgotten first. (This leak kept an idle lock's subscription
// for the connection's life when a client's first Subscribe came before its
// pub/sub connection was up.)
func TestMachineFailedSubscribeIsUnsubscribed(t *testing.T) {
	for _, granted := range []bool{true, false} {
		t.Run(fmt.Sprintf("granted=%v", granted), func(t *testing.T) {
			h := newMH(t)
			w := h.acquire("L", 1, 0, -1)
			att := h.take().one(t, scripts.LockAcquire)
			h.reply(att, replyPTTL(30*time.Second), nil)
			h.take()
			h.m.handle(subscribeDone{lock: h.lockID("L"), err: errConn}, h.now)
			retry := h.take().armed(kindRetry)
			if len(retry) != 1 {
				t.Fatalf("retry timers %+v, want one", retry)
			}
			if granted {
				h.fire(retry[0].key)
				again := h.take().one(t, scripts.LockAcquire)
				h.reply(again, replyNil, nil)
				mustGranted(t, "the retry", w.future)
			} else {
				h.cancelCtx(w)
			}
			if us := h.take().unsubscribes(); len(us) != 1 {
				t.Fatalf("%d unsubscribes once the queue emptied, want 1", len(us))
			}
			if granted {
				c, _ := h.unlockCall(t, "L", 1, scripts.LockRelease)
				h.reply(c, replyInt(2), nil)
				h.take()
			}
			if !h.live("L") {
				t.Fatal("the lock's state was forgotten with the unsubscribe in flight")
			}
			h.m.handle(unsubscribeDone{lock: h.lockID("L")}, h.now)
			if h.live("L") {
				t.Fatal("the lock's state kept after the unsubscribe")
			}
		})
	}
}

// Yielding to unregistered listeners (directgrant.go): a registered head that hears
// a public unlock message, and the releasing client's head after its release at
// the chain bound went public, wait cfg.publicYield before they attempt.
func TestMachineYieldToPublic(t *testing.T) {
	yielding := func(t *testing.T) *mh {
		h := newMH(t, func(c *config) { c.publicYield = time.Millisecond })
		h.m.grantSub = subSubscribed
		return h
	}
	t.Run("a registered head waits, once however many messages", func(t *testing.T) {
		h := yielding(t)
		w, att := h.registeredWaiter(t, "L", 1)
		h.reply(att, replyPTTL(30*time.Second), nil)
		h.take()
		h.notice("L")
		s := h.take()
		if len(s.calls(scripts.LockAcquire)) != 0 {
			t.Fatalf("attempt at once on a public message: %v", s)
		}
		armed := s.armed(kindRetry)
		if len(armed) != 1 || armed[0].d != time.Millisecond {
			t.Fatalf("retry timers armed %+v, want one of 1 ms", armed)
		}
		h.notice("L")
		if s := h.take(); len(s.scripts) != 0 || len(s.armed(kindRetry)) != 0 {
			t.Fatalf("a second message during the yield: %v; want nothing", s)
		}
		h.fire(armed[0].key)
		if c := h.take().one(t, scripts.LockAcquire); c.waiter != w.id {
			t.Fatalf("attempt of %d after the yield, want %d", c.waiter, w.id)
		}
	})
	t.Run("an unregistered head races at once", func(t *testing.T) {
		h := yielding(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(30*time.Second), nil)
		h.take()
		h.notice("L")
		if c := h.take().one(t, scripts.LockAcquire); c.waiter != w.id {
			t.Fatalf("attempt of %d, want %d", c.waiter, w.id)
		}
	})
	t.Run("the releasing head after a public release at the chain bound", func(t *testing.T) {
		h := newMH(t, func(c *config) { c.publicYield = time.Millisecond; c.handoffChain = 1 })
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 0, -1)
		w := h.acquire("L", 3, 0, -1)
		h.take()
		h.unlock("L", a.owner)
		h.reply(h.take().one(t, scripts.LockHandoff), replyInt(5), nil) // the chain's first; others listen
		h.take()
		h.unlock("L", 2)
		c := h.take().one(t, scripts.LockHandoff)
		if c.args[4] != "1" || c.early {
			t.Fatalf("handoff args %v early %v, want a bounded one", c.args, c.early)
		}
		h.notice("L") // its own unlock message, before the reply
		h.reply(c, replyInt(1), nil)
		s := h.take()
		if len(s.calls(scripts.LockAcquire)) != 0 {
			t.Fatalf("the releasing head attempted at once: %v", s)
		}
		armed := s.armed(kindRetry)
		if len(armed) != 1 || armed[0].d != time.Millisecond {
			t.Fatalf("retry timers armed %+v, want one of 1 ms", armed)
		}
		h.fire(armed[0].key)
		if c := h.take().one(t, scripts.LockAcquire); c.waiter != w.id {
			t.Fatalf("attempt of %d after the yield, want %d", c.waiter, w.id)
		}
	})
}

// A yield stands for the message it delays: a leave that re-registers the next head
// meanwhile must not re-park the lock for a lease, which would lose that message.
func TestMachineYieldSurvivesLeave(t *testing.T) {
	h := newMH(t, func(c *config) { c.publicYield = time.Millisecond })
	h.m.grantSub = subSubscribed
	a, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	b := h.acquire("L", 2, 0, -1)
	h.take()
	h.notice("L")
	yield := h.take().armed(kindRetry)
	if len(yield) != 1 || yield[0].d != time.Millisecond {
		t.Fatalf("retry timers %+v, want the 1 ms yield", yield)
	}
	h.cancelCtx(a) // the registered head leaves: owner 2's waiter registers in its place
	s := h.take()
	leave := s.one(t, scripts.LockLeave)
	h.reply(leave, replyInt(0), nil)
	for _, r := range append(s.armed(kindRetry), h.take().armed(kindRetry)...) {
		if r.d > time.Millisecond {
			t.Fatalf("retry re-armed for %v during the yield: the message's attempt would wait that long", r.d)
		}
	}
	l := h.lock("L")
	h.fire(timer.Key{Kind: kindRetry, ID: l.id, Gen: l.retryGen})
	if c := h.take().one(t, scripts.LockAcquire); c.waiter != b.id {
		t.Fatalf("attempt of %d, want %d", c.waiter, b.id)
	}
}

// The releasing client's own unlock message may arrive after lock_handoff's reply 1
// (the two come on different connections): the pending yield takes it in (review
// finding: it used to end the yield for a client whose waiters chain locally).
func TestMachineYieldOwnMessageAfterReply(t *testing.T) {
	h := newMH(t, func(c *config) { c.publicYield = time.Millisecond; c.handoffChain = 1 })
	a := h.grantFresh("L", 1, 0)
	h.acquire("L", 2, 0, -1)
	h.acquire("L", 3, 0, -1)
	h.take()
	h.unlock("L", a.owner)
	h.reply(h.take().one(t, scripts.LockHandoff), replyInt(5), nil) // others listen
	h.take()
	h.unlock("L", 2)
	c := h.take().one(t, scripts.LockHandoff)
	h.reply(c, replyInt(1), nil) // released to everyone
	if s := h.take(); len(s.scripts) != 0 || len(s.armed(kindRetry)) != 1 {
		t.Fatalf("after reply 1: %v, want the yield only", s)
	}
	h.notice("L") // its own unlock message, after the reply
	if s := h.take(); len(s.calls(scripts.LockAcquire)) != 0 {
		t.Fatalf("its own message after the reply ended the yield: %v", s)
	}
}

// Only a registered head yields to a public message: the lock's registered flag
// outlives the registration (review finding: a head that never registered, in a
// client whose registration a grant had consumed, yielded).
func TestMachineYieldOnlyRegisteredHeads(t *testing.T) {
	h := newMH(t, func(c *config) { c.publicYield = time.Millisecond; c.handoffChain = 1 })
	h.m.grantSub = subSubscribed
	a, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.subscribed("L")
	h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(30*time.Second), nil)
	h.take()
	b := h.acquire("L", 2, 0, -1)
	h.acquire("L", 3, 0, -1)
	h.take()
	h.grantMessage(a) // a takes a direct grant: the grant consumed this client's registration
	h.take()
	mustGranted(t, "a", a.future)
	h.unlock("L", 1) // early handoff to b
	hc := h.take().one(t, scripts.LockHandoff)
	mustGranted(t, "b", b.future)
	h.reply(hc, replyInt(5), nil) // a Redisson waiter listens
	h.take()
	h.unlock("L", 2) // at the bound: released to everyone (a Redisson waiter listens)
	hc = h.take().one(t, scripts.LockHandoff)
	h.reply(hc, replyInt(1), nil)
	y := h.take().retryArmed(t)
	h.fire(y.key)
	first := h.take().one(t, scripts.LockAcquire)
	if len(first.args) != 2 {
		t.Fatalf("c's first attempt args %v, want no registration", first.args)
	}
	h.reply(first, replyPTTL(30*time.Second), nil) // the Redisson waiter took it
	h.take()
	h.notice("L") // the Redisson holder releases
	if s := h.take(); len(s.calls(scripts.LockAcquire)) != 1 {
		t.Fatalf("an unregistered head yielded on a public message: %v", s)
	}
}

// A lock_leave whose retry fails too is sent again after a back-off until it runs,
// without the registration of the next waiter it carried (stale by then): left
// undone, a direct grant to the gone waiter would hold the lock for nobody until
// its lease ends, and its registration would outlive it in Redis (found by a storm
// that kills connections: the registration keys outlived it, 1 run in 70).
func TestMachineDirectGrantLeaveRetriedUntilItRuns(t *testing.T) {
	h := withGrants(t)
	w, next, first := h.registeredLeaves(t)
	if first.args[5] == "" {
		t.Fatalf("setup: leave args %q, want the next waiter's registration", first.args)
	}
	h.reply(first, scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.LockLeave), scripts.Reply{}, errConn) // retryOnce's
	h.leaveResentAfterBackOffs(t, scripts.LockLeave, replyInt(0), nil, func(try int, again scriptCall) {
		if again.args[1] != fmt.Sprint(w.id) || again.args[2] != h.m.grantFieldOf(w.id) || again.args[5] != "" {
			t.Fatalf("try %d: leave args %q, want w's id and field and no registration", try, again.args)
		}
	})
	if len(h.m.leaveRetries) != 0 {
		t.Fatalf("leave retries %v after the leave ran", h.m.leaveRetries)
	}
	mustPending(t, "the next waiter", next.future)
}

// Close drops the grant channel, and a grant heard while closing goes back: while
// this client listened there, other clients' releases counted its registrations as
// live, and a grant whose message came after the engine stopped would hold the
// lock for nobody until its lease ended (another client stalled for the lease in a
// test that closes a client mid-contention, 2 runs in 288 with 16 in parallel).
func TestMachineCloseDropsGrantChannel(t *testing.T) {
	h := withGrants(t)
	w, att := h.registeredWaiter(t, "L", 1)
	h.reply(att, replyPTTL(30*time.Second), nil)
	h.take()
	h.m.handle(closeMsg{}, h.now)
	s := h.take()
	var dropped bool
	for _, op := range s.unsubscribes() {
		dropped = dropped || op.channel == h.m.grantChannel
	}
	if !dropped {
		t.Fatalf("Close's effects %v: want the grant channel unsubscribed", s)
	}
	leave := s.one(t, scripts.LockLeave) // the waiter's registration goes
	h.grantMessage(w)                    // made before the leave ran, heard before the unsubscription's reply
	back := h.take().one(t, scripts.LockLeave)
	if back.args[2] != h.m.grantFieldOf(w.id) {
		t.Fatalf("give-back of field %q, want w's grant field", back.args[2])
	}
	h.reply(leave, replyInt(0), nil)
	h.reply(back, replyInt(1), nil)
	h.m.handle(unsubscribeDone{}, h.now)
	if h.m.grantSub != subNone {
		t.Errorf("grant subscription state %v after the unsubscription, want none", h.m.grantSub)
	}

	// A subscription still on its way at Close is dropped once confirmed.
	h = newMH(t)
	h.m.grantSub = subSubscribing
	h.m.handle(closeMsg{}, h.now)
	h.take()
	h.m.handle(subscribeDone{}, h.now)
	if s := h.take().unsubscribes(); len(s) != 1 || s[0].channel != h.m.grantChannel {
		t.Fatalf("unsubscribes %v after the late confirmation, want the grant channel's", s)
	}
}

// A Subscribe that failed after the lock's last waiter left: the lock does not
// count as subscribed (lingering as if it were, it would let the next waiter wait
// for messages that may never come); what the registry kept is unsubscribed, and
// the next waiter subscribes afresh once that is done.
func TestMachineSubscribeFailedAfterQueueEmptied(t *testing.T) {
	h := newMH(t, func(c *config) { c.linger = 250 * time.Millisecond })
	h.grantFresh("L", 100, 0)
	w := h.acquire("L", 1, 0, -1)
	if subs := h.take().subscribes(); len(subs) != 1 {
		t.Fatalf("parked waiter: %d subscribes, want 1", len(subs))
	}
	h.cancelCtx(w)
	h.take()
	h.m.handle(subscribeDone{lock: h.lockID("L"), err: errConn}, h.now)
	if l := h.lock("L"); l.sub == subSubscribed {
		t.Fatal("the lock counts as subscribed after its Subscribe failed")
	}
	if us := h.take().unsubscribes(); len(us) != 1 {
		t.Fatalf("%d unsubscribes of what the failed Subscribe left, want 1", len(us))
	}
	h.acquire("L", 2, 0, -1)
	h.take()
	h.m.handle(unsubscribeDone{lock: h.lockID("L")}, h.now)
	if subs := h.take().subscribes(); len(subs) != 1 {
		t.Fatalf("the next waiter: %d subscribes, want 1", len(subs))
	}
}
