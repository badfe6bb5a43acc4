package engine

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
	"github.com/redis/rueidis"
)

// Layer 1: the acquire path of the pure state machine — attempts, parking,
// wake-ups, FIFO order, cancellation, deadlines and errors.

func TestMachineAcquireFreeLock(t *testing.T) {
	tests := []struct {
		name      string
		lease     time.Duration
		wantLease string        // ARGV[1] of the acquire script
		wantExp   time.Duration // expiry timer: lease minus the safety margin
		wantSweep bool
	}{
		{"watchdog", 0, "30000", 30*time.Second - 500*time.Millisecond, true},
		{"explicit lease", 5 * time.Second, "5000", 5*time.Second - 250*time.Millisecond, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t)
			w := h.acquire("L", 7, tt.lease, -1)

			s := h.take()
			att := s.one(t, scripts.LockAcquire)
			if want := []string{"L"}; !slices.Equal(att.keys, want) {
				t.Errorf("keys %v, want %v", att.keys, want)
			}
			if want := []string{tt.wantLease, "cid:7"}; !slices.Equal(att.args, want) {
				t.Errorf("args %v, want %v", att.args, want)
			}
			if att.purpose != purposeAttempt || att.waiter != w.id {
				t.Errorf("purpose %v waiter %d, want attempt for %d", att.purpose, att.waiter, w.id)
			}
			// The first attempt subscribes the grant channel (directgrant.go), and
			// registers nothing until that is confirmed; the lock's channel waits
			// for a refusal.
			if len(s.subs) != 1 || s.subs[0].channel != "leash_lock_grant:cid" {
				t.Errorf("subscribed %v before any refusal, want the grant channel alone", s)
			}
			mustPending(t, "waiter with attempt in flight", w.future)

			h.reply(att, replyNil, nil)
			s = h.take()
			mustGranted(t, "waiter", w.future)
			hd := h.hold("L", 7)
			if hd == nil || hd.count != 1 || hd.field != "cid:7" {
				t.Fatalf("hold = %+v, want count 1 for cid:7", hd)
			}
			exp := s.armed(kindExpiry)
			sweep := s.armed(kindSweep)
			if tt.wantSweep {
				// A watchdog hold's expiry entry waits for the first sweep.
				if len(exp) != 0 {
					t.Errorf("expiry timers %+v at the grant of a watchdog hold, want none before the sweep", exp)
				}
				h.fire(timer.Key{Kind: kindSweep})
				exp = h.take().armed(kindExpiry)
			}
			if len(exp) != 1 || exp[0].key.ID != hd.id || exp[0].d != tt.wantExp {
				t.Errorf("expiry timers %+v, want one for hold %d in %v", exp, hd.id, tt.wantExp)
			}
			if got := len(sweep) == 1; got != tt.wantSweep {
				t.Errorf("sweep armed = %v, want %v (%v)", got, tt.wantSweep, s)
			}
			if tt.wantSweep && sweep[0].d != 30*time.Second/12 {
				t.Errorf("sweep in %v, want %v", sweep[0].d, 30*time.Second/12)
			}
			if len(s.scripts) != 0 || len(s.subs) != 0 {
				t.Errorf("grant ran more effects: %v", s)
			}
			if st := h.m.snapshot(); st.Waiters != 0 || st.Holds != 1 || st.Grants != 1 || st.Attempts != 1 {
				t.Errorf("stats %+v", st)
			}
		})
	}
}

// A refused attempt parks the waiter: the lock's channel is subscribed and a retry
// timer is armed for when the holder's lease could run out, capped by the wait
// left. Nothing else runs until a wake-up.
func TestMachineRefusalParks(t *testing.T) {
	tests := []struct {
		name  string
		wait  time.Duration
		pttl  scripts.Reply
		retry time.Duration
	}{
		{"no wait limit: the PTTL", -1, replyPTTL(5 * time.Second), 5 * time.Second},
		{"wait shorter than PTTL", 2 * time.Second, replyPTTL(5 * time.Second), 2 * time.Second},
		{"PTTL shorter than wait", 10 * time.Second, replyPTTL(time.Second), time.Second},
		{"no expiry on the key", -1, replyInt(-1), noTTLRetry},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t)
			w := h.acquire("L", 1, 0, tt.wait)
			s := h.take()
			att := s.one(t, scripts.LockAcquire)
			if tt.wait > 0 {
				if ops := s.armed(kindWait); len(ops) != 1 || ops[0].d != tt.wait || ops[0].key.ID != w.id {
					t.Errorf("wait timer %+v, want %v for waiter %d", ops, tt.wait, w.id)
				}
			}

			h.reply(att, tt.pttl, nil)
			s = h.take()
			mustPending(t, "refused waiter", w.future)
			if subs := s.subscribes(); len(subs) != 1 || subs[0].channel != "redisson_lock__channel:{L}" {
				t.Errorf("subscribe effects %+v, want one for redisson_lock__channel:{L}", subs)
			}
			if op := s.retryArmed(t); op.d != tt.retry {
				t.Errorf("retry armed in %v, want %v", op.d, tt.retry)
			}
			if got := s.calls(scripts.LockAcquire); len(got) != 0 {
				t.Errorf("refusal started %d more attempt(s) at once (a busy retry loop against Redis), want 0: %v", len(got), s)
			}
		})
	}
}

// Once the subscription is confirmed, a release that happened between the refusal
// and the subscription went unheard: the head retries exactly once.
func TestMachineSubscribeDoneRetriesOnce(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(5*time.Second), nil)
	h.take()

	h.subscribed("L")
	s := h.take()
	if len(s.scripts) == 0 && h.lock("L").attempting != nil {
		t.Fatal("an attempt was already in flight when the subscription was confirmed: the refusal did not park (see TestMachineRefusalParks)")
	}
	att := s.one(t, scripts.LockAcquire)
	if att.waiter != w.id {
		t.Fatalf("retry for waiter %d, want %d", att.waiter, w.id)
	}
	h.reply(att, replyNil, nil)
	mustGranted(t, "waiter after subscribe retry", w.future)
}

// The tests below all start from a head parked behind a holder in another process.
// From there, only a wake-up (unlock notice, retry timer, resubscription, local
// release) may cost a script call; everything else must queue or leave quietly.
func TestMachineParkedHeadStaysParked(t *testing.T) {
	tests := []struct {
		name  string
		event func(h *mh, head, mid *tw)
	}{
		{"second waiter arrives", func(h *mh, head, mid *tw) {
			h.acquire("L", 9, 0, -1)
		}},
		{"middle waiter cancelled", func(h *mh, head, mid *tw) {
			h.cancelCtx(mid)
		}},
		{"middle waiter's wait runs out", func(h *mh, head, mid *tw) {
			h.now = h.now.Add(time.Hour)
			h.fire(timer.Key{Kind: kindWait, ID: mid.id})
		}},
		{"stale retry timer of an earlier park", func(h *mh, head, mid *tw) {
			h.fire(timer.Key{Kind: kindRetry, ID: h.lockID("L"), Gen: 1})
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newMH(t)
			head := h.acquire("L", 1, 0, -1)
			mid := h.acquire("L", 2, 0, time.Hour)
			h.acquire("L", 3, 0, -1)
			h.reply(h.take().one(t, scripts.LockAcquire), replyPTTL(5*time.Second), nil)
			s := h.take()
			if n := len(s.calls(scripts.LockAcquire)); n != 0 {
				t.Fatalf("refusal started %d attempt(s) at once, want 0 (head must park): %v", n, s)
			}
			tt.event(h, head, mid)
			if s := h.take(); len(s.calls(scripts.LockAcquire)) != 0 {
				t.Errorf("parked head attempted again without a wake-up: %v", s)
			}
			mustPending(t, "head", head.future)
		})
	}
}

// A transport error leaves the waiter queued and arms a retry with a backoff that
// doubles up to maxBackoff; it does not retry at once.
func TestMachineTransportErrorBacksOff(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	att := h.take().one(t, scripts.LockAcquire)
	want := minBackoff
	for i := range 8 {
		h.reply(att, scripts.Reply{}, errConn)
		s := h.take()
		mustPending(t, "waiter after transport error", w.future)
		if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{w.id}) {
			t.Fatalf("round %d: queue %v, want [%d]", i, ids, w.id)
		}
		op := s.retryArmed(t)
		if op.d != want {
			t.Errorf("round %d: retry in %v, want %v", i, op.d, want)
		}
		if n := len(s.calls(scripts.LockAcquire)); n != 0 {
			t.Fatalf("round %d: transport error retried at once (%d attempts), want only the backoff timer: %v", i, n, s)
		}
		h.fire(op.key)
		att = h.take().one(t, scripts.LockAcquire)
		want = min(2*want, maxBackoff)
	}
	h.reply(att, replyNil, nil)
	mustGranted(t, "waiter after transport errors", w.future)
}

// A Redis error reply will not go away by retrying: the waiter fails with it,
// wrapped with the lock's name and still recognisable.
func TestMachineRedisErrorFailsWaiter(t *testing.T) {
	h := newMH(t)
	w := h.acquire("L", 1, 0, -1)
	redisErr := new(rueidis.RedisError) // IsRedisErr only checks the type
	if _, ok := rueidis.IsRedisErr(redisErr); !ok {
		t.Fatal("test setup: not a Redis error")
	}
	h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, redisErr)
	err := mustGet(t, "waiter after Redis error", w.future)
	var got *rueidis.RedisError
	if !errors.As(err, &got) || got != redisErr {
		t.Fatalf("got %v, want the Redis error wrapped", err)
	}
	if h.live("L") {
		t.Errorf("lock state kept after its only waiter failed")
	}
	if st := h.m.snapshot(); st.Waiters != 0 || st.Holds != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestMachineOneShot(t *testing.T) {
	t.Run("refused", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, 0)
		s := h.take()
		att := s.one(t, scripts.LockAcquire)
		if len(h.queueIDs("L")) != 0 || len(s.armed(kindWait)) != 0 {
			t.Fatalf("one-shot queued or armed a wait timer: queue %v, %v", h.queueIDs("L"), s)
		}
		h.reply(att, replyPTTL(5*time.Second), nil)
		s = h.take()
		err := mustGet(t, "one-shot", w.future)
		if !errors.Is(err, ErrNotAcquired) || err == ErrNotAcquired {
			t.Fatalf("got %v, want ErrNotAcquired wrapped with the lock name", err)
		}
		if len(s.scripts) != 0 || len(s.subs) != 0 || len(s.armed(kindRetry)) != 0 {
			t.Errorf("one-shot refusal ran effects: %v", s)
		}
		if h.live("L") {
			t.Errorf("lock state kept after a one-shot")
		}
	})
	t.Run("does not queue behind a parked waiter", func(t *testing.T) {
		h := newMH(t)
		h.grantFresh("L", 100, 0)
		head := h.acquire("L", 1, 0, -1) // parked behind the local holder
		h.take().none(t)
		w := h.acquire("L", 2, 0, 0)
		att := h.take().one(t, scripts.LockAcquire)
		if att.waiter != w.id {
			t.Fatalf("attempt for %d, want the one-shot %d", att.waiter, w.id)
		}
		if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{head.id}) {
			t.Fatalf("queue %v, want only the head", ids)
		}
		h.reply(att, replyPTTL(30*time.Second), nil)
		if err := mustGet(t, "one-shot", w.future); !errors.Is(err, ErrNotAcquired) {
			t.Fatalf("got %v, want ErrNotAcquired", err)
		}
		if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{head.id}) {
			t.Fatalf("queue %v after the one-shot, want only the head", ids)
		}
		mustPending(t, "head", head.future)
	})
	t.Run("transport error", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, 0)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
		if err := mustGet(t, "one-shot", w.future); !errors.Is(err, errConn) {
			t.Fatalf("got %v, want the transport error", err)
		}
		// Not retried; but the script may have run before the connection failed, so
		// an owner-guarded release of everything the owner may hold follows.
		s := h.take()
		if len(s.armed(kindRetry)) != 0 {
			t.Errorf("one-shot retried: %v", s)
		}
		c := s.one(t, scripts.LockReleaseOwner)
		if want := []string{"0", "cid:1", "0"}; !slices.Equal(c.args, want) {
			t.Errorf("cleanup args %v, want %v", c.args, want)
		}
	})
}

func TestMachineWaitDeadline(t *testing.T) {
	t.Run("parked", func(t *testing.T) {
		// Parked behind a local holder (no refusal involved), with a wait of 2 s.
		h := newMH(t)
		start := h.now
		h.grantFresh("L", 100, 0)
		w := h.acquire("L", 1, 0, 2*time.Second)
		s := h.take()
		s.none(t)
		if op := s.retryArmed(t); op.d != 2*time.Second {
			t.Errorf("retry armed in %v, want the wait left, 2s", op.d)
		}
		if len(s.subscribes()) != 1 {
			t.Errorf("parked waiter did not subscribe: %v", s)
		}
		h.subscribed("L")
		// The subscription's one retry (wasted here: this process holds the lock) is
		// refused; the head parks behind the local holder again.
		if s := h.take(); len(s.scripts) == 1 {
			h.reply(s.scripts[0], replyPTTL(30*time.Second), nil)
		}
		h.take().none(t)
		key := timer.Key{Kind: kindWait, ID: w.id}

		// An early firing (the wheel runs on the wall clock) re-arms for what is left.
		h.now = start.Add(time.Second)
		h.fire(key)
		s = h.take()
		if ops := s.armed(kindWait); len(ops) != 1 || ops[0].d != time.Second {
			t.Fatalf("early firing re-armed %+v, want one in 1s", ops)
		}
		mustPending(t, "waiter fired early", w.future)

		h.now = start.Add(2 * time.Second)
		h.fire(key)
		s = h.take()
		err := mustGet(t, "waiter out of time", w.future)
		if !errors.Is(err, ErrNotAcquired) || err == ErrNotAcquired {
			t.Fatalf("got %v, want ErrNotAcquired wrapped with the lock name", err)
		}
		if w.stops.Load() != 1 {
			t.Errorf("AfterFunc unregistered %d times, want 1", w.stops.Load())
		}
		if len(s.unsubscribes()) != 1 || len(s.cancelled(kindRetry)) != 1 {
			t.Errorf("last waiter left without unsubscribing and disarming the retry: %v", s)
		}
		s.none(t)
		if st := h.m.snapshot(); st.Waiters != 0 {
			t.Errorf("stats %+v", st)
		}
	})
	t.Run("runs out during an attempt", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, time.Second)
		att := h.take().one(t, scripts.LockAcquire)
		h.now = h.now.Add(time.Second)
		h.fire(timer.Key{Kind: kindWait, ID: w.id})
		mustPending(t, "waiter with attempt in flight", w.future)
		h.reply(att, replyPTTL(5*time.Second), nil)
		if err := mustGet(t, "waiter", w.future); !errors.Is(err, ErrNotAcquired) {
			t.Fatalf("got %v, want ErrNotAcquired", err)
		}
	})
	t.Run("after transport errors reports the last one", func(t *testing.T) {
		// lockapi documents: ErrNotAcquired, or the last error if Redis could not
		// be reached.
		h := newMH(t)
		w := h.acquire("L", 1, 0, time.Second)
		h.reply(h.take().one(t, scripts.LockAcquire), scripts.Reply{}, errConn)
		h.take()
		h.now = h.now.Add(time.Second)
		h.fire(timer.Key{Kind: kindWait, ID: w.id})
		if err := mustGet(t, "waiter", w.future); !errors.Is(err, errConn) {
			t.Fatalf("got %v, want the transport error", err)
		}
	})
}

// An unlock notice is one permit for the head. One that arrives while the head's
// attempt is in flight is remembered: after a refusal the head retries exactly once
// more (the attempt may have run before the release), and then parks again.
func TestMachineNoticeDuringAttemptRetriesOnce(t *testing.T) {
	h := newMH(t)
	w := h.heldElsewhere("L", 1, -1, 5*time.Second)

	h.notice("L")
	att := h.take().one(t, scripts.LockAcquire)
	h.notice("L")
	h.notice("L") // several notices in flight still make one permit
	h.take().none(t)
	if !h.lock("L").wakePending {
		t.Fatal("notice during an attempt not remembered")
	}

	h.reply(att, replyPTTL(5*time.Second), nil)
	att = h.take().one(t, scripts.LockAcquire)
	if att.waiter != w.id {
		t.Fatalf("retry for %d, want %d", att.waiter, w.id)
	}
	h.reply(att, replyPTTL(5*time.Second), nil)
	s := h.take()
	if n := len(s.calls(scripts.LockAcquire)); n != 0 {
		t.Fatalf("second refusal started %d more attempt(s), want 0 (park): %v", n, s)
	}
	s.retryArmed(t)
	mustPending(t, "waiter", w.future)
}

// N notices with K queued waiters cost N attempts, all by the head: one script call
// per message per process, not one per waiter.
func TestMachineNoticesCostOneAttemptEach(t *testing.T) {
	const k, n = 5, 7
	h := newMH(t)
	head := h.heldElsewhere("L", 1, -1, 5*time.Second)
	for i := range k - 1 {
		h.acquire("L", uint64(2+i), 0, -1)
	}
	h.take() // a parked head must not attempt here; TestMachineParkedHeadStaysParked checks that

	attempts := 0
	for i := range n {
		h.notice("L")
		s := h.take()
		calls := s.calls(scripts.LockAcquire)
		if len(calls) != 1 {
			t.Fatalf("notice %d: %d attempts, want 1: %v", i, len(calls), s)
		}
		if calls[0].waiter != head.id {
			t.Fatalf("notice %d: attempt by %d, want the head %d", i, calls[0].waiter, head.id)
		}
		attempts++
		h.reply(calls[0], replyPTTL(5*time.Second), nil)
		attempts += len(h.take().calls(scripts.LockAcquire))
	}
	if attempts != n {
		t.Errorf("%d notices with %d waiters cost %d attempts, want %d", n, k, attempts, n)
	}
	if got := len(h.queueIDs("L")); got != k {
		t.Errorf("queue length %d, want %d", got, k)
	}
}

// FIFO: local waiters get the lock in arrival order, through handoffs and through
// releases.
func TestMachineFIFO(t *testing.T) {
	for _, handoff := range []bool{true, false} {
		name := "release"
		if handoff {
			name = "handoff"
		}
		t.Run(name, func(t *testing.T) {
			h := newMH(t, func(c *config) {
				if !handoff {
					c.handoffChain = -1
				}
			})
			holder := h.grantFresh("L", 100, 0)
			var ws []*tw
			for i := range 5 {
				ws = append(ws, h.acquire("L", uint64(1+i), 0, -1))
			}
			h.take().none(t) // waiters behind a local holder park without attempting

			prev := holder
			for i, w := range ws {
				f := h.unlock("L", prev.owner)
				if handoff {
					c := h.take().one(t, scripts.LockHandoff)
					if c.waiter != w.id {
						t.Fatalf("handoff %d to waiter %d, want %d", i, c.waiter, w.id)
					}
					h.reply(c, replyInt(2), nil)
				} else {
					h.reply(h.take().one(t, scripts.LockRelease), replyInt(1), nil)
					att := h.attemptAfterRelease(t, "L")
					if att.waiter != w.id {
						t.Fatalf("attempt %d by waiter %d, want %d", i, att.waiter, w.id)
					}
					h.reply(att, replyNil, nil)
				}
				mustGranted(t, "unlock", f)
				mustGranted(t, "waiter", w.future)
				for _, later := range ws[i+1:] {
					mustPending(t, "later waiter", later.future)
				}
				h.take()
				prev = w
			}
		})
	}
}

// Cancellation of a queued waiter takes it out of the queue at once, wherever it
// stands; cancelling the head makes the next waiter the head.
func TestMachineCancelQueuedWaiter(t *testing.T) {
	h := newMH(t)
	holder := h.grantFresh("L", 100, 0)
	var ws []*tw
	for i := range 4 {
		ws = append(ws, h.acquire("L", uint64(1+i), 0, -1))
	}
	h.take()

	h.cancelCtx(ws[2]) // a middle waiter
	if err := mustGet(t, "cancelled middle waiter", ws[2].future); err != context.Canceled {
		t.Fatalf("got %v, want context.Canceled unchanged", err)
	}
	if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{ws[0].id, ws[1].id, ws[3].id}) {
		t.Fatalf("queue %v after cancelling %d", ids, ws[2].id)
	}
	if ws[2].stops.Load() != 1 {
		t.Errorf("AfterFunc unregistered %d times, want 1", ws[2].stops.Load())
	}
	h.take().none(t)

	h.cancelCtx(ws[0]) // the head
	if err := mustGet(t, "cancelled head", ws[0].future); err != context.Canceled {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if ids := h.queueIDs("L"); !slices.Equal(ids, []uint64{ws[1].id, ws[3].id}) {
		t.Fatalf("queue %v after cancelling the head", ids)
	}
	h.take().none(t)

	// The next head is the one served.
	h.unlock("L", holder.owner)
	if c := h.take().one(t, scripts.LockHandoff); c.waiter != ws[1].id {
		t.Fatalf("handoff to %d, want the new head %d", c.waiter, ws[1].id)
	}
	// ws[1] was granted at once (an early handoff), ws[3] still waits.
	if st := h.m.snapshot(); st.Waiters != 1 || st.EarlyGrants != 1 {
		t.Errorf("waiters %d, early grants %d, want 1 and 1", st.Waiters, st.EarlyGrants)
	}
}

// Cancellation racing a grant, in each order it can happen.
func TestMachineCancelRacingGrant(t *testing.T) {
	// releaseOwner checks s holds exactly one owner-guarded release of one hold.
	releaseOwner := func(t *testing.T, s step, owner string) {
		t.Helper()
		c := s.one(t, scripts.LockReleaseOwner)
		if want := []string{"0", owner, "1"}; !slices.Equal(c.args, want) {
			t.Errorf("release_owner args %v, want %v", c.args, want)
		}
		if want := []string{"L", "redisson_lock__channel:{L}"}; !slices.Equal(c.keys, want) {
			t.Errorf("release_owner keys %v, want %v", c.keys, want)
		}
	}
	// tookBackOneOfTwo checks s gives back one count of owner 1's hold, keeping
	// the other (ARGV[4]: the count it keeps), and w's grant was revoked; it
	// returns the give-back.
	tookBackOneOfTwo := func(t *testing.T, s step, w *tw) scriptCall {
		t.Helper()
		c := s.one(t, scripts.LockReleaseOwner)
		if !slices.Equal(c.args, []string{"0", "cid:1", "1", "1"}) {
			t.Fatalf("release_owner args %v, want one count given back and one kept", c.args)
		}
		if err := mustGet(t, "walked-away grant", w.future); err != context.Canceled {
			t.Fatalf("got %v, want context.Canceled in place of the grant", err)
		}
		return c
	}

	t.Run("cancel during the attempt, then a grant", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		att := h.take().one(t, scripts.LockAcquire)
		h.cancelCtx(w)
		mustPending(t, "waiter with attempt in flight", w.future)
		h.reply(att, replyNil, nil)
		if err := mustGet(t, "cancelled waiter", w.future); err != context.Canceled {
			t.Fatalf("got %v, want context.Canceled", err)
		}
		releaseOwner(t, h.take(), "cid:1")
		if h.hold("L", 1) != nil {
			t.Error("hold kept after the grant was given back")
		}
		if st := h.m.snapshot(); st.Waiters != 0 || st.Receipts != 0 || st.Holds != 0 {
			t.Errorf("stats %+v", st)
		}
	})
	t.Run("cancel during the attempt, then a refusal", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		att := h.take().one(t, scripts.LockAcquire)
		h.cancelCtx(w)
		h.reply(att, replyPTTL(time.Second), nil)
		if err := mustGet(t, "cancelled waiter", w.future); err != context.Canceled {
			t.Fatalf("got %v, want context.Canceled", err)
		}
		h.take().none(t)
	})
	t.Run("grant unreceived, then cancel", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		if st := h.m.snapshot(); st.Receipts != 1 {
			t.Fatalf("receipts %d, want 1 (the grant's context is still watched)", st.Receipts)
		}
		lost := h.hold("L", 1).lostSignal().C()
		h.cancelCtx(w)
		releaseOwner(t, h.take(), "cid:1")
		if err := mustGet(t, "revoked grant", w.future); err != context.Canceled {
			t.Fatalf("got %v, want context.Canceled in place of the grant", err)
		}
		if h.hold("L", 1) != nil {
			t.Error("hold kept after the revoke")
		}
		mustNotFired(t, "Lost of a grant nobody received", lost)
		if st := h.m.snapshot(); st.Revoked != 1 || st.Receipts != 0 {
			t.Errorf("stats %+v", st)
		}
	})
	t.Run("grant received, then cancel", func(t *testing.T) {
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		mustGranted(t, "waiter", w.future)
		h.cancelCtx(w)
		h.take().none(t)
		if h.hold("L", 1) == nil {
			t.Fatal("received grant dropped on a later cancel")
		}
		if st := h.m.snapshot(); st.Revoked != 0 || st.Receipts != 0 {
			t.Errorf("stats %+v", st)
		}
	})
	t.Run("hold ends, receipt goes with it", func(t *testing.T) {
		// The context stays watched while the hold lives; the hold's end
		// unregisters the AfterFunc, and a late cancel does nothing.
		h := newMH(t)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		mustGranted(t, "waiter", w.future)
		if w.stops.Load() != 0 {
			t.Fatalf("AfterFunc unregistered at the grant; the receipt must keep it")
		}
		f := h.unlock("L", 1)
		h.reply(h.take().one(t, scripts.LockRelease), replyInt(1), nil)
		mustGranted(t, "unlock", f)
		if w.stops.Load() != 1 {
			t.Errorf("AfterFunc unregistered %d times after the hold ended, want 1", w.stops.Load())
		}
		if st := h.m.snapshot(); st.Receipts != 0 {
			t.Errorf("receipts %d, want 0", st.Receipts)
		}
		h.take()
		h.cancelCtx(w)
		h.take().none(t)
	})
	t.Run("walked-away grant goes back before the handle's next acquire", func(t *testing.T) {
		// Two goroutines share a handle: one holds, the other's re-entry is granted
		// but it walked away (its context ended) before its cancellation came. The
		// handle's next acquire gives that grant back first, so it never counts a
		// hold nobody has (a shared-handle storm saw HoldCount 3 with two
		// goroutines).
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		w := h.acquire("L", 1, 0, -1)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.take()
		w.cancel() // walked away; its cancelMsg is still to come
		next := h.acquire("L", 1, 0, -1)
		give := tookBackOneOfTwo(t, h.take(), w)
		h.reply(give, replyInt(1), nil)
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		mustGranted(t, "the next acquire", next.future)
		if hd := h.hold("L", 1); hd == nil || hd.count != 2 {
			t.Fatalf("hold %+v, want the first count and the next acquire's", hd)
		}
	})
	t.Run("deferred grant is not taken for received", func(t *testing.T) {
		// The engine defers completing grants to the end of the step (deliver).
		// A second grant to the same hold in that step prunes the hold's receipts
		// (pruneReceipts): the first grant's future is not completed yet, so its
		// empty channel does not mean it was received. Dropped, its receipt
		// could not take the grant back when the caller walked away, and the
		// handle would keep a count nobody holds (a shared-handle storm saw
		// HoldCount 3 with two goroutines).
		h := newMH(t)
		h.grantFresh("L", 1, 0)
		h.m.deferGrants = true
		w := h.acquire("L", 1, 0, -1) // a re-entry, granted by its reply
		h.reply(h.take().one(t, scripts.LockAcquire), replyNil, nil)
		h.m.pruneReceipts(h.hold("L", 1)) // as a second grant in the same step does
		h.m.flushGrants()
		h.m.deferGrants = false
		h.take()
		h.cancelCtx(w) // walked away without receiving
		tookBackOneOfTwo(t, h.take(), w)
		if hd := h.hold("L", 1); hd == nil || hd.count != 1 {
			t.Fatalf("hold after the take-back: %+v, want the first count only", hd)
		}
	})
}
