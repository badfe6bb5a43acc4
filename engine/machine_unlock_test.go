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

// Layer 1: unlock, re-entry and the local handoff.

func TestMachineUnlock(t *testing.T) {
	t.Run("not held", func(t *testing.T) {
		h := newMH(t)
		f := h.unlock("L", 1)
		if err := mustGet(t, "unlock", f); !errors.Is(err, ErrNotHeld) {
			t.Fatalf("got %v, want ErrNotHeld", err)
		}
		h.take().none(t)
	})
	t.Run("held by another owner", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 2, 0)
		if err := mustGet(t, "unlock", h.unlock("L", 1)); !errors.Is(err, ErrNotHeld) {
			t.Fatalf("got %v, want ErrNotHeld", err)
		}
		h.take().none(t)
	})

	tests := []struct {
		name      string
		reply     scripts.Reply
		err       error
		wantErr   error // errors.Is
		wantCount int   // 0: hold gone
		wantLost  bool
	}{
		{"reply 0: still held, one count less", replyInt(0), nil, nil, 1, false},
		{"reply 1: released", replyInt(1), nil, nil, 0, false},
		{"reply nil: the hold was gone", replyNil, nil, ErrNotHeld, 0, true},
		// Whether it ran is unknown: the hold counts as lost and its field goes,
		// owner-guarded (so the watchdog does not renew it for ever).
		{"transport error, twice", scripts.Reply{}, errConn, errConn, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t)
			h.grantFresh("L", 1, 0)
			h.grantFresh("L", 1, 0) // re-entry: count 2
			hd := h.hold("L", 1)
			if hd.count != 2 {
				t.Fatalf("count %d after re-entry, want 2", hd.count)
			}
			h.fire(timer.Key{Kind: kindSweep}) // arms the hold's expiry entry
			if exp := h.take().armed(kindExpiry); len(exp) != 1 {
				t.Fatalf("the first sweep armed expiry entries %+v, want the hold's", exp)
			}
			lost := hd.lostSignal().C()

			f := h.unlock("L", 1)
			c := h.take().one(t, scripts.LockRelease)
			if want := []string{"L", "redisson_lock__channel:{L}", "leash_lock_reg:{L}", "leash_lock_regq:{L}"}; !slices.Equal(c.keys, want) {
				t.Errorf("keys %v, want %v", c.keys, want)
			}
			// The last argument is the count the hold keeps (1), which keeps a retry
			// of a release that ran from taking the other count too.
			if want := []string{"0", "30000", "cid:1", "cid", "0", "0", "1"}; !slices.Equal(c.args, want) {
				t.Errorf("args %v, want %v", c.args, want)
			}
			mustPending(t, "unlock in flight", f)

			h.reply(c, tt.reply, tt.err)
			if tt.err != nil {
				// A transport error is retried once, at once, with the same call.
				r := h.take().one(t, scripts.LockRelease)
				if !slices.Equal(r.args, c.args) {
					t.Errorf("retry args %v, want %v", r.args, c.args)
				}
				mustPending(t, "unlock while retrying", f)
				h.reply(r, tt.reply, tt.err)
			}
			s := h.take()
			err := mustGet(t, "unlock", f)
			if tt.wantErr == nil && err != nil || tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("unlock got %v, want %v", err, tt.wantErr)
			}
			got := h.hold("L", 1)
			switch {
			case tt.wantCount == 0 && got != nil:
				t.Errorf("hold kept (count %d), want dropped", got.count)
			case tt.wantCount != 0 && (got == nil || got.count != tt.wantCount):
				t.Errorf("hold %+v, want count %d", got, tt.wantCount)
			}
			if tt.wantCount == 0 && len(s.cancelled(kindExpiry)) != 1 {
				t.Errorf("expiry timer of the dropped hold not cancelled: %v", s)
			}
			if tt.wantLost {
				mustFired(t, "Lost", lost)
			} else {
				mustNotFired(t, "Lost", lost)
			}
			if tt.err != nil {
				if r := s.one(t, scripts.LockReleaseOwner); !slices.Equal(r.args, []string{"0", "cid:1", "0"}) {
					t.Errorf("release_owner args %v, want owner 1's field, all holds", r.args)
				}
				return
			}
			s.none(t)
		})
	}
}

// A holder re-entering goes straight to Redis, past waiters queued behind it:
// queueing it behind waiters that wait for it would deadlock.
func TestMachineReentryBypassesQueue(t *testing.T) {
	h := newMH(t)
	holder := h.grantFresh("L", 1, 0)
	waiter := h.acquire("L", 2, 0, -1)
	h.take().none(t)

	again := h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	if att.waiter != again.id {
		t.Fatalf("attempt for %d, want the re-entry %d", att.waiter, again.id)
	}
	if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{waiter.id}) {
		t.Fatalf("queue %v, want only the other owner's waiter", ids)
	}
	h.reply(att, replyNil, nil)
	mustGranted(t, "re-entry", again.future)
	if c := h.hold("L", 1).count; c != 2 {
		t.Fatalf("count %d, want 2", c)
	}

	// Two counts: the first unlock decrements, it does not hand over.
	h.take()
	c, _ := h.unlockCall(t, "L", holder.owner, scripts.LockRelease)
	h.reply(c, replyInt(0), nil)
	if c := h.hold("L", 1).count; c != 1 {
		t.Fatalf("count %d, want 1", c)
	}
	h.take()
	h.unlock("L", holder.owner)
	if c := h.take().one(t, scripts.LockHandoff); c.waiter != waiter.id {
		t.Fatalf("handoff to %d, want %d", c.waiter, waiter.id)
	}
}

// A re-entry whose attempt hits a transport error must still be retried: the
// owner holds the lock, so the waiters queued behind it can never get it first.
func TestMachineReentryTransportErrorIsRetried(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	other := h.acquire("L", 2, 0, -1)
	h.take()

	again := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
	s := h.take()
	op := s.retryArmed(t)

	// Whatever wakes up next must retry the re-entry, not the waiter that waits
	// for this very holder.
	h.fire(op.key)
	s = h.take()
	for _, c := range s.calls(scripts.LockAcquire) {
		if c.waiter == other.id {
			t.Errorf("the retry went to waiter %d, which waits for owner 1's hold; owner 1's re-entry (waiter %d, "+
				"queue %v) is stuck behind it until its context ends", other.id, again.id, h.queueIDs("L"))
		}
	}
	if cs := s.calls(scripts.LockAcquire); len(cs) != 1 || cs[0].waiter != again.id {
		t.Fatalf("want one retry of the re-entry %d, got: %v", again.id, s)
	}
}

// The handoff without an early grant: the releasing owner's lease is too short for
// the receiver to run under it (see handoff.go), so the receiver is granted by the
// reply.
func TestMachineHandoff(t *testing.T) {
	setup := func(t *testing.T) (*mh, *tw, *tw) {
		h := newMH(t)
		a := h.grantFresh("L", 1, 80*time.Millisecond)
		b := h.acquire("L", 2, 5*time.Second, -1)
		h.take().none(t) // parked behind the local holder: no attempt
		return h, a, b
	}

	t.Run("handed over", func(t *testing.T) {
		h, a, b := setup(t)
		lostA := h.hold("L", 1).lostSignal().C()
		f := h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff) // not a release plus an attempt
		if want := []string{"L", "redisson_lock__channel:{L}", "leash_lock_reg:{L}", "leash_lock_regq:{L}"}; !slices.Equal(c.keys, want) {
			t.Errorf("keys %v, want %v", c.keys, want)
		}
		if want := []string{"cid:1", "80", "cid:2", "5000", "0", "0", "0", "cid", "0", "", strconv.FormatUint(b.id, 10), "1"}; !slices.Equal(c.args, want) {
			t.Errorf("args %v, want %v", c.args, want)
		}
		mustPending(t, "unlock", f)
		mustPending(t, "receiver", b.future)

		h.reply(c, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		mustGranted(t, "receiver", b.future)
		if h.hold("L", 1) != nil {
			t.Error("releasing owner's hold kept")
		}
		if hb := h.hold("L", 2); hb == nil || hb.count != 1 || hb.lease != 5*time.Second {
			t.Errorf("receiver's hold %+v, want count 1 with a 5s lease", hb)
		}
		mustNotFired(t, "releasing owner's Lost", lostA)
		if st := h.m.snapshot(); st.Handoffs != 1 || st.Holds != 1 || st.Waiters != 0 {
			t.Errorf("stats %+v", st)
		}
		h.take().none(t)
	})
	t.Run("releasing owner still holds (reply 0)", func(t *testing.T) {
		// The handoff is only tried at local count 1, so reply 0 means the server
		// counted more than this handle knows of (an acquire retried after an
		// ambiguous transport error): nobody owns the surplus, so it is released.
		h, a, b := setup(t)
		f := h.unlock("L", a.owner)
		h.reply(h.take().one(t, scripts.LockHandoff), replyInt(0), nil)
		mustGranted(t, "unlock", f)
		mustPending(t, "receiver", b.future)
		if h.hold("L", 1) != nil {
			t.Error("surplus hold kept")
		}
		c := h.take().one(t, scripts.LockReleaseOwner)
		if want := []string{"0", "cid:1", "0"}; !slices.Equal(c.args, want) {
			t.Errorf("args %v, want %v (drop every count of the owner)", c.args, want)
		}
	})
	t.Run("releasing owner had lost it (reply nil)", func(t *testing.T) {
		h, a, b := setup(t)
		lostA := h.hold("L", 1).lostSignal().C()
		f := h.unlock("L", a.owner)
		h.reply(h.take().one(t, scripts.LockHandoff), replyNil, nil)
		if err := mustGet(t, "unlock", f); !errors.Is(err, ErrNotHeld) {
			t.Fatalf("unlock got %v, want ErrNotHeld", err)
		}
		mustFired(t, "releasing owner's Lost", lostA)
		// Nothing is held locally any more: the receiver tries on its own.
		if c := h.take().one(t, scripts.LockAcquire); c.waiter != b.id {
			t.Fatalf("attempt by %d, want %d", c.waiter, b.id)
		}
	})
	t.Run("transport error", func(t *testing.T) {
		// Whether the handoff ran is unknown: the releasing hold counts as lost
		// (the watchdog must not renew it for ever) and its field goes, guarded.
		h, a, b := setup(t)
		lost := h.hold("L", 1).lostSignal().C()
		f := h.unlock("L", a.owner)
		h.reply(h.take().one(t, scripts.LockHandoff), scripts.Reply{}, errConn)
		if err := mustGet(t, "unlock", f); !errors.Is(err, errConn) {
			t.Fatalf("unlock got %v, want the transport error", err)
		}
		mustFired(t, "the releasing hold's Lost", lost)
		mustPending(t, "receiver", b.future)
		s := h.take()
		if r := s.one(t, scripts.LockReleaseOwner); !slices.Equal(r.args, []string{"0", "cid:1", "0"}) {
			t.Errorf("release_owner args %v, want owner 1's field, all holds", r.args)
		}
		s.retryArmed(t)
		if h.hold("L", 1) != nil {
			t.Error("hold kept after an ambiguous error")
		}
	})
	t.Run("receiver cancelled during the handoff", func(t *testing.T) {
		h, a, b := setup(t)
		f := h.unlock("L", a.owner)
		c := h.take().one(t, scripts.LockHandoff)
		h.cancelCtx(b)
		mustPending(t, "receiver with handoff in flight", b.future)
		h.reply(c, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		if err := mustGet(t, "receiver", b.future); !errors.Is(err, b.ctx.Err()) {
			t.Fatalf("receiver got %v, want its context's error", err)
		}
		r := h.take().one(t, scripts.LockReleaseOwner)
		if r.args[1] != "cid:2" || r.args[2] != "1" {
			t.Errorf("release_owner args %v, want one hold of cid:2", r.args)
		}
		if h.hold("L", 2) != nil || h.hold("L", 1) != nil {
			t.Error("holds kept")
		}
	})
	t.Run("disabled", func(t *testing.T) {
		h := newMH(t, func(c *config) { c.handoffChain = -1 })
		a := h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 0, -1)
		h.take()
		h.unlock("L", a.owner)
		h.take().one(t, scripts.LockRelease)
	})
}

// A chain of local handoffs reaches its bound after handoffChain handoffs or
// handoffAge, whichever comes first: then the handoff script is told so, and (when
// other processes listen) releases the lock to everyone, so their waiters hear
// about it. "handoff" and "release" below are both lock_handoff calls, without and
// with the bound flag; a "handoff" is answered 5 (handed over, and somebody else
// listens: see noteListeners), a "release" 1 (released to everyone).
func TestMachineHandoffChainBound(t *testing.T) {
	const handoff, release = "handoff", "release"
	tests := []struct {
		name  string
		chain int
		age   time.Duration
		step  time.Duration // time between unlocks
		want  []string      // per unlock
	}{
		{"by count", 3, time.Hour, time.Millisecond,
			[]string{handoff, handoff, handoff, release, handoff}},
		{"by age", 100, 5 * time.Millisecond, 3 * time.Millisecond,
			[]string{handoff, handoff, release, handoff, handoff}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t, func(c *config) { c.handoffChain, c.handoffAge = tt.chain, tt.age })
			holder := h.grantFresh("L", 100, 0)
			var ws []*tw
			for i := range len(tt.want) {
				ws = append(ws, h.acquire("L", uint64(1+i), 0, -1))
			}
			h.take()
			prev := holder
			for i, want := range tt.want {
				h.now = h.now.Add(tt.step)
				f := h.unlock("L", prev.owner)
				c := h.take().one(t, scripts.LockHandoff)
				if bound := c.args[4] == "1"; bound != (want == release) {
					t.Fatalf("unlock %d: bound flag %q, want %s", i, c.args[4], want)
				}
				switch want {
				case handoff:
					h.reply(c, replyInt(5), nil) // handed over; another process listens
				case release:
					// Released to everyone; the local head competes on its own attempt.
					h.reply(c, replyInt(1), nil)
					att := h.attemptAfterRelease(t, "L")
					if att.waiter != ws[i].id {
						t.Fatalf("unlock %d: attempt by %d, want %d", i, att.waiter, ws[i].id)
					}
					h.reply(att, replyNil, nil)
				}
				mustGranted(t, "unlock", f)
				mustGranted(t, "next waiter", ws[i].future)
				h.take()
				prev = ws[i]
			}
		})
	}
}

// An Unlock that answers nil to a handle whose local count was 1 leaves that handle
// without a hold. If the server still had a count for it (an acquire whose reply was
// lost to a transport error, then retried), the engine must not keep renewing a
// hold nobody owns.
func TestMachineUnlockCountMismatch(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	// The script ran on the server (count 1) but the reply was lost.
	h.reply(att, scripts.Reply{}, errConn)
	op := h.take().retryArmed(t)
	h.fire(op.key)
	// The retry re-enters on the server (count 2) and is granted.
	h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
	mustGranted(t, "waiter", w.future)
	h.take()

	f := h.unlock("L", 1)
	h.reply(h.take().one(t, scripts.LockRelease), replyInt(0), nil) // the server still has count 1
	mustGranted(t, "unlock", f)
	s := h.take()
	if hd := h.hold("L", 1); hd != nil && len(s.calls(scripts.LockReleaseOwner)) == 0 {
		t.Fatalf("after the caller's only Unlock returned nil, the engine keeps hold %d (count %d) and the watchdog "+
			"renews it forever: the lock is never released; want the hold dropped and the owner's field cleared "+
			"(release_owner with drop 0)", hd.id, hd.count)
	}
}

// A transport error sets the lock backing off until its retry timer fires. If the
// waiter leaves before that, the timer is disarmed; the next waiter must not inherit
// a back-off that nothing will ever end.
func TestMachineBackoffOutlivesItsWaiter(t *testing.T) {
	h := newMH(t, func(c *config) { c.linger = 250 * time.Millisecond }) // the engine's default
	holder := h.grantFresh("L", 100, 0)
	a := h.acquire("L", 1, 0, -1) // parks behind the local holder: subscribes
	h.take()
	h.subscribed("L")
	att := h.take().one(t, scripts.LockAcquire) // the subscription's retry
	h.reply(att, scripts.Reply{}, errConn)      // back off
	h.take().retryArmed(t)

	h.cancelCtx(a) // the only waiter leaves: retry timer disarmed, subscription lingers
	h.take()
	c, _ := h.unlockCall(t, "L", holder.owner, scripts.LockRelease)
	h.reply(c, replyInt(1), nil) // the lock is free now
	h.take()

	b := h.acquire("L", 2, 0, -1)
	s := h.take()
	if len(s.calls(scripts.LockAcquire)) == 0 && len(s.armed(kindRetry)) == 0 {
		t.Fatalf("a new waiter on a free lock got no attempt and no timer (the lock still says backingOff=%v "+
			"with no retry armed): waiter %d waits until an unlock message that may never come: %v",
			h.lock("L").backingOff, b.id, s)
	}
}

// The expiry timer's key is the hold id; firing it for a hold that is gone does
// nothing.
func TestMachineStaleTimers(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	id := h.hold("L", 1).id
	f := h.unlock("L", 1)
	h.reply(h.take().one(t, scripts.LockRelease), replyInt(1), nil)
	mustGranted(t, "unlock", f)
	h.take()
	h.now = h.now.Add(time.Hour)
	h.fire(timer.Key{Kind: kindExpiry, ID: id})
	h.fire(timer.Key{Kind: kindWait, ID: 12345})
	h.fire(timer.Key{Kind: kindRetry, ID: 999, Gen: 1})
	h.fire(timer.Key{Kind: kindLinger, ID: 999, Gen: 1})
	h.take().none(t)
}

// A release retried after a transport error that finds the owner's field gone means
// the first try ran: the Unlock succeeded, and the hold ends without Lost.
func TestMachineUnlockRetryAfterAmbiguousFailure(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	lost := h.hold("L", 1).lostSignal().C()
	f := h.unlock("L", 1)
	h.reply(h.take().one(t, scripts.LockRelease), scripts.Reply{}, errConn)
	h.reply(h.take().one(t, scripts.LockRelease), replyNil, nil)
	if err := mustGet(t, "unlock", f); err != nil {
		t.Fatalf("unlock got %v, want nil", err)
	}
	if h.hold("L", 1) != nil {
		t.Error("hold kept")
	}
	mustNotFired(t, "Lost", lost)
}

// Two lost wake-ups found by the relay's stress run (relay.go), both possible
// before it: the head must retry after this client's own release whenever the
// release's unlock message may have gone unheard.
func TestMachineReleaseWakesLateWaiters(t *testing.T) {
	t.Run("the unlock message came before the waiter", func(t *testing.T) {
		// The release's own message arrives before its reply, when no local waiter
		// listens; a waiter that comes next parks behind the local hold. The
		// reply must make it try.
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		c, f := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.notice("L")
		w := h.acquire("L", 2, 0, -1)
		h.take().none(t) // parked: this client still holds the lock
		h.reply(c, replyInt(1), nil)
		mustGranted(t, "unlock", f)
		att := h.take().one(t, scripts.LockAcquire)
		if att.waiter != w.id {
			t.Fatalf("attempt of waiter %d, want %d", att.waiter, w.id)
		}
	})
	t.Run("an attempt ran before a release that published nothing", func(t *testing.T) {
		// Reply 2: nobody else listened, so no message comes. An attempt in flight
		// ran before the release and is refused: its head must try once more.
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		h.acquire("L", 2, 0, -1)
		h.take()
		h.notice("L") // a stale message: the head tries while owner 1 still holds
		att := h.take().one(t, scripts.LockAcquire)
		c, f := h.unlockCall(t, "L", 1, scripts.LockRelease)
		h.reply(c, replyInt(2), nil)
		mustGranted(t, "unlock", f)
		h.reply(att, replyPTTL(20*time.Second), nil)
		again := h.take().one(t, scripts.LockAcquire)
		h.reply(again, replyNil, nil)
		if h.hold("L", 2) == nil {
			t.Fatal("the head's retry did not take the lock")
		}
	})
}

// An Unlock whose release finds the field gone after the hold was already dropped
// as lost (a force-release from this client, answered first) reports ErrLockLost,
// not ErrNotHeld: the hold was lost, not never held.
func TestMachineUnlockAfterForceReleaseReportsLost(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	c, f := h.unlockCall(t, "L", 1, scripts.LockRelease)
	ff := futures.New[forceResult]()
	h.m.handle(forceUnlockMsg{lock: "L", future: ff}, h.now)
	h.reply(h.take().one(t, scripts.LockForceRelease), replyInt(1), nil)
	if h.hold("L", 1) != nil {
		t.Fatal("the force-released hold kept")
	}
	h.reply(c, replyNil, nil)
	if err := mustGet(t, "unlock", f); !errors.Is(err, ErrLockLost) {
		t.Fatalf("unlock got %v, want ErrLockLost", err)
	}
	if _, kept := h.m.lostHolds[holdKey{h.lockID("L"), 1}]; kept {
		t.Error("the lost-hold entry kept after the Unlock answered it")
	}
}

// A waiter that gives up during the back-off after an ambiguous attempt (a
// transport error: the script may have run) cleans up what it may have taken,
// owner-guarded; but not while another call of the same owner is in flight (a
// TryLock of the same handle), which the cleanup could follow and undo.
func TestMachineGiveUpAfterAmbiguousAttempt(t *testing.T) {
	t.Run("nothing else in flight: cleaned up", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
		h.take()
		h.cancelCtx(w)
		c := h.take().one(t, scripts.LockReleaseOwner)
		if c.args[1] != "cid:1" || c.args[2] != "0" {
			t.Errorf("cleanup args %q, want all of owner 1's field", c.args)
		}
		if err := mustGet(t, "the waiter", w.future); !errors.Is(err, context.Canceled) {
			t.Errorf("the waiter got %v, want its context's error", err)
		}
	})
	t.Run("a TryLock of the owner in flight: left alone", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
		h.take()
		try := h.acquire("L", 1, 0, 0)
		s := h.take()
		calls := s.calls(scripts.LockAcquire)
		if len(calls) != 1 {
			t.Fatalf("the TryLock made %d calls during the back-off, want its attempt: %v", len(calls), s)
		}
		h.cancelCtx(w)
		if rel := h.take().calls(scripts.LockReleaseOwner); len(rel) != 0 {
			t.Fatalf("cleanup sent while the owner's TryLock is in flight: %v", rel)
		}
		h.reply(calls[0], replyNil, nil)
		if rel := h.take().calls(scripts.LockReleaseOwner); len(rel) != 0 {
			t.Fatalf("cleanup sent after the TryLock took the lock: %v", rel)
		}
		mustGranted(t, "the TryLock", try.future)
	})
}

// An Unlock releases the hold its caller was granted: the owner's hold when it
// arrives. Two goroutines share a handle; one's hold is lost, and the other's Lock
// of the same handle is in flight when the first calls Unlock. Parked behind that
// call and handled after it, the Unlock used to release the hold the Lock had just
// taken, so that goroutine was inside with nothing on the server (found by a storm
// that kills connections, owner-shared handles, 1 run in 4).
func TestMachineUnlockBoundToItsHold(t *testing.T) {
	t.Run("no hold when it arrives", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		ff := futures.New[forceResult]()
		h.m.handle(forceUnlockMsg{lock: "L", future: ff}, h.now)
		h.reply(h.take().one(t, scripts.LockForceRelease), replyInt(1), nil) // the hold is lost
		h.take()
		other := h.acquire("L", 1, 0, -1) // the other goroutine's Lock: queued, its attempt in flight
		att := h.take().one(t, scripts.LockAcquire)
		f := h.unlock("L", 1)
		if err := mustGet(t, "unlock of the lost hold", f); !errors.Is(err, ErrLockLost) {
			t.Fatalf("unlock got %v, want ErrLockLost at once", err)
		}
		h.reply(att, replyNil, nil)
		mustGranted(t, "the other goroutine's Lock", other.future)
		h.take().none(t) // nothing releases the new hold
		if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
			t.Fatalf("hold %+v after the grant, want count 1", hd)
		}
	})
	t.Run("its hold lost while it waits", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 1, time.Second)
		try := h.acquire("L", 1, 0, 0) // a TryLock of the handle: a re-entry in flight
		att := h.take().one(t, scripts.LockAcquire)
		f := h.unlock("L", 1) // waits behind the TryLock
		h.take().none(t)
		mustPending(t, "unlock", f)
		// The hold's lease runs out (as far as the engine can tell), and the
		// TryLock, whose script ran after it, takes the lock: a new hold of the
		// same owner, under the same field.
		h.now = h.now.Add(2 * time.Second)
		h.fire(timer.Key{Kind: kindExpiry, ID: h.hold("L", 1).id})
		if h.hold("L", 1) != nil {
			t.Fatal("setup: the expired hold kept")
		}
		if s := h.take(); len(s.calls(scripts.LockReleaseOwner)) > 0 {
			// Sent now, it could run after the TryLock and delete the hold it takes.
			t.Fatalf("the lost hold's release went while the owner's TryLock was in flight: %v", s)
		}
		h.reply(att, replyNil, nil)
		mustGranted(t, "TryLock", try.future)
		if err := mustGet(t, "unlock of the expired hold", f); !errors.Is(err, ErrLockLost) {
			t.Fatalf("unlock got %v, want ErrLockLost", err)
		}
		if s := h.take(); len(s.calls(scripts.LockRelease))+len(s.calls(scripts.LockHandoff))+len(s.calls(scripts.LockReleaseOwner)) > 0 {
			t.Fatalf("the Unlock of the expired hold, or its clean-up, released the TryLock's hold: %v", s)
		}
		hd := h.hold("L", 1)
		if hd == nil || hd.count != 1 || !hd.maySurplus {
			t.Fatalf("hold %+v after the TryLock, want count 1 and maySurplus (the server may still count the lost hold)", hd)
		}
	})
}

// Close loses every hold, and a lost hold's field is released owner-guarded once
// the owner's call in flight is answered (releaseLost). The lock's state must stay
// until then: Close forgets a state as soon as nothing refers to it, and the
// parked release, finding no state, was dropped, so the lock stayed held by the
// closed client until its lease ran out (a storm closing a client mid-run, 1 run
// in 4).
func TestMachineCloseReleasesAfterOwnersCall(t *testing.T) {
	h := newMH(t)
	h.grantFresh("L", 1, 0)
	h.grantFresh("L", 1, 0) // count 2
	c, f := h.unlockCall(t, "L", 1, scripts.LockRelease)
	h.m.handle(closeMsg{}, h.now)
	if s := h.take(); len(s.calls(scripts.LockReleaseOwner)) != 0 {
		t.Fatalf("the lost hold's release went while the owner's Unlock was in flight: %v", s)
	}
	h.reply(c, replyInt(0), nil) // one count less; the other is Close's to release
	mustGet(t, "unlock", f)
	rel := h.take().one(t, scripts.LockReleaseOwner)
	if rel.args[1] != "cid:1" || rel.args[2] != "0" {
		t.Fatalf("release args %q, want all of cid:1", rel.args)
	}
}
