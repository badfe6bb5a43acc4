package lockapi_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// numSub returns how many subscribers channel has on srv.
func numSub(t *testing.T, srv *testredis.Server, channel string) string {
	t.Helper()
	out := do(t, srv, "PUBSUB", "NUMSUB", channel)
	parts := strings.Split(out, "\n")
	if len(parts) != 2 {
		t.Fatalf("PUBSUB NUMSUB %s = %q", channel, out)
	}
	return parts[1]
}

// TestRedisRestartedUnderHeldLock: the server dies with a watchdog-held lock and a
// queued waiter, and comes back empty, at once or only after the holder's lease.
// The holder must learn it lost the lock within the watchdog timeout, and the
// waiter must get the lock once Redis is back.
func TestRedisRestartedUnderHeldLock(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		restartAfterLost bool
	}{
		{"RestartAtOnce", false},
		{"RestartAfterLost", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			redisRestarted(t, tc.restartAfterLost)
		})
	}
}

func redisRestarted(t *testing.T, restartAfterLost bool) {
	srv := testredis.New(t)
	const watchdog = time.Second
	holder := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog, OpTimeout: 500 * time.Millisecond})
	waiter := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog, OpTimeout: 500 * time.Millisecond})
	name := lockName(t, "")

	h := holder.Mutex(name)
	lockWithin(t, h, 5*time.Second)
	lost := h.Lost()
	w := waiter.Mutex(name)
	wch := w.Acquire(ctxFor(t, 60*time.Second))
	eventually(t, 5*time.Second, "the waiter to queue and subscribe", func() bool {
		return stats(t, waiter).Waiters == 1 && numSub(t, srv, engine.ChannelName(name)) == "1"
	})
	if still, err := pending(wch, 50*time.Millisecond); !still {
		t.Fatalf("waiter completed while the lock is held: %v", err)
	}

	killedAt := time.Now()
	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	restart := func() {
		if err := srv.Restart(); err != nil {
			t.Fatal(err)
		}
		t.Logf("server back after %v", time.Since(killedAt))
	}
	if !restartAfterLost {
		restart()
	}
	select {
	case <-lost:
		t.Logf("holder's Lost closed %v after the kill", time.Since(killedAt))
	case <-time.After(3*time.Second - time.Since(killedAt)):
		t.Fatalf("holder's Lost still open %v after the kill (watchdog %v)", time.Since(killedAt), watchdog)
	}
	if restartAfterLost {
		restart()
	}
	err, ok := receive(wch, 10*time.Second)
	if !ok {
		t.Fatalf("waiter did not get the lock within 10s of the restart (stats %+v)", stats(t, waiter))
	}
	if err != nil {
		t.Fatalf("waiter after the restart: %v", err)
	}
	t.Logf("waiter got the lock %v after the kill", time.Since(killedAt))
	if v := soleField(t, srv, waiter, name); v != "1" {
		t.Fatalf("waiter's count = %q", v)
	}
	isErr(t, "old holder's Unlock", h.Unlock(ctxFor(t, 5*time.Second)), lockapi.ErrNotHeld)
	unlock(t, w)
	mustBeLocked(t, srv, name, false)
}

// TestLostWhenRedisFreezes: renewals hang while the server is frozen; the holder's
// Lost must close by its own clock before the lease could have run out, and the
// hold must be gone on the server once it answers again.
func TestLostWhenRedisFreezes(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	const watchdog = 600 * time.Millisecond
	c := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog})
	name := lockName(t, "")

	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	lost := m.Lost()
	pausedAt, resume := freeze(t, srv)
	select {
	case <-lost:
	case <-time.After(3 * time.Second):
		t.Fatalf("Lost still open %v into the freeze (watchdog %v)", time.Since(pausedAt), watchdog)
	}
	took := time.Since(pausedAt)
	t.Logf("Lost closed %v after the server froze (watchdog %v)", took, watchdog)
	// The last successful renewal was sent before the freeze, so the lease ends by
	// pausedAt + watchdog at the latest. Generous slack for a loaded machine.
	if took > watchdog+300*time.Millisecond {
		t.Errorf("Lost closed %v after the freeze; the lease (%v) could have expired first", took, watchdog)
	}
	resume()
	eventually(t, 5*time.Second, "the lost hold to be gone on the server", func() bool {
		return do(t, srv, "EXISTS", name) == "0"
	})
	isErr(t, "Unlock of a lost hold", m.Unlock(ctxFor(t, 5*time.Second)), lockapi.ErrNotHeld)
	lockWithin(t, c.Mutex(name), 5*time.Second)
}

// TestPubSubReconnect: the waiter's pub/sub connection is killed server-side while
// it waits. The holder's lease is 30 s, so only a delivered (or re-checked) unlock
// can wake the waiter promptly.
func TestPubSubReconnect(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		waitResubbed bool // unlock only after the waiter has subscribed again
	}{
		{name: "UnlockWhileDisconnected"},
		{name: "UnlockAfterResubscribe", waitResubbed: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			holder := newClient(t, srv, lockapi.Options{})
			waiter := newClient(t, srv, lockapi.Options{})
			name := lockName(t, "")
			channel := engine.ChannelName(name)

			h := holder.Mutex(name)
			lockWithin(t, h, 5*time.Second, lockapi.WithLease(30*time.Second))
			w := waiter.Mutex(name)
			wch := w.Acquire(ctxFor(t, 60*time.Second))
			eventually(t, 5*time.Second, "the waiter to subscribe", func() bool {
				return stats(t, waiter).Waiters == 1 && numSub(t, srv, channel) == "1"
			})
			if n := do(t, srv, "CLIENT", "KILL", "TYPE", "pubsub"); n == "0" {
				t.Fatal("CLIENT KILL TYPE pubsub killed nothing")
			}
			if tc.waitResubbed {
				eventually(t, 5*time.Second, "the waiter to subscribe again", func() bool {
					return numSub(t, srv, channel) == "1"
				})
			}
			start := time.Now()
			unlock(t, h)
			err, ok := receive(wch, 5*time.Second)
			if !ok || err != nil {
				t.Fatalf("waiter after the pub/sub connection was killed and the holder unlocked: ok=%v err=%v (stats %+v)",
					ok, err, stats(t, waiter))
			}
			t.Logf("waiter got the lock %v after the unlock", time.Since(start))
			soleField(t, srv, waiter, name)
			unlock(t, w)
		})
	}
}

func TestCancelWaiter(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	holderC := newClient(t, srv, lockapi.Options{})
	otherC := newClient(t, srv, lockapi.Options{})
	for _, tc := range []struct {
		name   string
		waiter *lockapi.Client
	}{
		{"SameClient", holderC},
		{"OtherClient", otherC},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := lockName(t, "")
			h := holderC.Mutex(name)
			lockWithin(t, h, 5*time.Second)
			base := stats(t, tc.waiter).Waiters

			// (a) cancelled by the caller.
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			w := tc.waiter.Mutex(name)
			ch := w.Acquire(ctx)
			eventually(t, 5*time.Second, "the waiter to queue", func() bool { return stats(t, tc.waiter).Waiters == base+1 })
			cancel()
			err, ok := receive(ch, 2*time.Second)
			if !ok {
				t.Fatal("cancelled waiter got no answer")
			}
			if err != context.Canceled {
				t.Fatalf("cancelled waiter: err = %v (%T), want context.Canceled itself", err, err)
			}
			eventually(t, 2*time.Second, "the cancelled waiter to leave the queue", func() bool {
				return stats(t, tc.waiter).Waiters == base
			})

			// (a') the same through Lock, which waits on ctx itself (no AfterFunc).
			lctx, lcancel := context.WithCancel(context.Background())
			defer lcancel()
			locked := make(chan error, 1)
			go func() { locked <- w.Lock(lctx) }()
			eventually(t, 5*time.Second, "Lock's waiter to queue", func() bool { return stats(t, tc.waiter).Waiters == base+1 })
			lcancel()
			if err, ok := receive(locked, 2*time.Second); !ok || err != context.Canceled {
				t.Fatalf("cancelled Lock: err = %v (received %v), want context.Canceled itself", err, ok)
			}
			eventually(t, 2*time.Second, "Lock's cancelled waiter to leave the queue", func() bool {
				return stats(t, tc.waiter).Waiters == base
			})

			// (b) a deadline.
			dctx, dcancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer dcancel()
			start := time.Now()
			err = w.Lock(dctx)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("Lock with a 200ms deadline: %v, want DeadlineExceeded", err)
			}
			if took := time.Since(start); took < 150*time.Millisecond || took > 3*time.Second {
				t.Fatalf("Lock with a 200ms deadline returned after %v", took)
			}
			// WithWait ends in ErrNotAcquired; TryLock says false.
			isErr(t, "Lock WithWait(100ms)", w.Lock(ctxFor(t, 10*time.Second), lockapi.WithWait(100*time.Millisecond)), lockapi.ErrNotAcquired)
			if ok, err := w.TryLock(ctxFor(t, 10*time.Second), 100*time.Millisecond, 0); ok || err != nil {
				t.Fatalf("TryLock(100ms) on a held lock = %v, %v; want false, nil", ok, err)
			}
			eventually(t, 2*time.Second, "the queue to empty", func() bool { return stats(t, tc.waiter).Waiters == base })

			// None of the walked-away waiters takes the lock when it is released.
			unlock(t, h)
			freedSoon(t, srv, name)
			if s := stats(t, tc.waiter); s.Holds != 0 || s.Receipts != 0 {
				t.Fatalf("waiter's client after the release: %+v", s)
			}
			if n, err := w.HoldCount(ctxFor(t, 5*time.Second)); err != nil || n != 0 {
				t.Fatalf("cancelled handle's HoldCount = %d, %v", n, err)
			}
		})
	}
}

// TestCancelSelectRace: callers select on Acquire and a short timer and, when the
// timer wins, cancel and walk away without reading the channel. A grant delivered
// into such a channel must be taken back: in the end nobody may hold the lock.
func TestCancelSelectRace(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	ca := newClient(t, srv, lockapi.Options{})
	cb := newClient(t, srv, lockapi.Options{})
	clients := []*lockapi.Client{ca, cb}
	name := lockName(t, "")

	var inside, violations atomic.Int32
	enter := func() {
		if inside.Add(1) != 1 {
			violations.Add(1)
		}
	}
	exit := func() { inside.Add(-1) }

	// One contender per client keeps the lock busy, holding it for a round trip.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := c.Mutex(name)
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				err := m.Lock(ctx)
				cancel()
				if err != nil {
					t.Errorf("contender Lock: %v", err)
					return
				}
				enter()
				if _, err := m.HoldCount(context.Background()); err != nil {
					t.Errorf("contender HoldCount: %v", err)
				}
				exit()
				if err := m.Unlock(context.Background()); err != nil {
					t.Errorf("contender Unlock: %v", err)
					return
				}
			}
		}()
	}

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	var took, walked int
	for i := range 200 {
		m := clients[i%2].Mutex(name)
		ctx, cancel := context.WithCancel(context.Background())
		timer := time.NewTimer(time.Duration(rng.IntN(3000)) * time.Microsecond)
		select {
		case err := <-m.Acquire(ctx):
			timer.Stop()
			if err != nil {
				t.Errorf("iteration %d: Acquire: %v", i, err)
				break
			}
			took++
			enter()
			exit()
			if err := m.Unlock(context.Background()); err != nil {
				t.Errorf("iteration %d: Unlock: %v", i, err)
			}
		case <-timer.C:
			walked++ // never read the channel
		}
		cancel()
	}
	close(stop)
	wg.Wait()

	var revoked uint64
	eventually(t, 10*time.Second, "nobody to hold the lock", func() bool {
		locked, err := ca.Mutex(name).IsLocked(context.Background())
		if err != nil || locked {
			return false
		}
		revoked = 0
		for _, c := range clients {
			s := stats(t, c)
			if s.Holds != 0 || s.Waiters != 0 || s.Receipts != 0 {
				return false
			}
			revoked += s.Revoked
		}
		return true
	})
	t.Logf("200 iterations: %d took the lock, %d walked away; %d grants taken back", took, walked, revoked)
	if v := violations.Load(); v != 0 {
		t.Fatalf("%d times two holders were inside at once", v)
	}
}

// TestFailedUnlockEndsWithLease: an Unlock that fails twice against a frozen server
// reports the error, and the hold counts as lost: its Lost is closed, nothing
// renews it, and the lock goes (an owner-guarded release, or at worst its lease).
// The watchdog used to renew such a hold for ever.
func TestFailedUnlockEndsWithLease(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{WatchdogTimeout: 2 * time.Second, OpTimeout: 300 * time.Millisecond})
	name := lockName(t, "")
	m := c.Mutex(name)
	lockWithin(t, m, 5*time.Second)
	_, resume := freeze(t, srv)
	err := m.Unlock(ctxFor(t, 10*time.Second))
	resume()
	if err == nil || errors.Is(err, lockapi.ErrNotHeld) {
		t.Fatalf("Unlock against a frozen server = %v, want a Redis error", err)
	}
	if !isClosed(m.Lost()) {
		t.Error("Lost still open after the failed Unlock")
	}
	if s := stats(t, c); s.Holds != 0 {
		t.Errorf("%d holds kept after the failed Unlock", s.Holds)
	}
	// Three leases: a renewed hold would still be there.
	eventually(t, 6*time.Second, "the lock to go", func() bool { return do(t, srv, "EXISTS", name) == "0" })
	if n, err := m.HoldCount(ctxFor(t, 5*time.Second)); err != nil || n != 0 {
		t.Errorf("HoldCount = %d, %v; want 0", n, err)
	}
}

// TestFailedSubscribeLeavesNoSubscription: waiters start while their client's
// pub/sub connection keeps being killed, so some of their subscribes fail, and they
// give up soon after. The registry keeps a channel whose Subscribe failed and
// subscribes it again on its next connection; once the connection stays up, no
// lock of theirs may be left subscribed (the engine unsubscribes what a failed
// Subscribe left behind), or the server would keep the subscription for the
// connection's life.
func TestFailedSubscribeLeavesNoSubscription(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	holder := newClient(t, srv, lockapi.Options{})
	waiter := newClient(t, srv, lockapi.Options{})
	const locks = 16
	var channels []string
	for i := range locks {
		name := lockName(t, strconv.Itoa(i))
		channels = append(channels, engine.ChannelName(name))
		lockWithin(t, holder.Mutex(name), 5*time.Second, lockapi.WithLease(30*time.Second))
	}

	stop := make(chan struct{})
	var killer sync.WaitGroup
	killer.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := srv.Do("CLIENT", "KILL", "TYPE", "pubsub"); err != nil {
				t.Errorf("CLIENT KILL: %v", err)
				return
			}
		}
	})
	for i := range locks {
		// Give up at a different moment each time: before, during or after the
		// first subscribe's answer.
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i)*time.Millisecond)
		if err := waiter.Mutex(lockName(t, strconv.Itoa(i))).Lock(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("lock %d: waiter got %v, want the deadline", i, err)
		}
		cancel()
	}
	close(stop)
	killer.Wait()
	// The registry reconnects after a back-off and subscribes again what it
	// kept, the client's grant channel included: once that is back, so is
	// anything a failed Subscribe left.
	grants := "leash_lock_grant:" + waiter.ID()
	eventually(t, 5*time.Second, "the waiter's pub/sub connection to be back", func() bool {
		return numSub(t, srv, grants) == "1"
	})
	eventually(t, 5*time.Second, "every lock's subscription to be dropped", func() bool {
		for _, ch := range channels {
			if numSub(t, srv, ch) != "0" {
				return false
			}
		}
		return true
	})
}
