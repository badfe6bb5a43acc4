package lockapi_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// A local handoff grants the next local waiter before its script's reply (see
// engine/handoff.go): the receiver's Lock returns, and what it then asks of Redis
// already shows its hold.
func TestLocalHandoffGrantsEarly(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	a, b := c.Mutex(name), c.Mutex(name)
	// A round is a plain release instead when the waiter's own attempt is in flight
	// at the Unlock (after its subscription, say), so rounds go on until one
	// grants early.
	for round := 0; ; round++ {
		if round == 20 {
			t.Fatalf("no early grant in %d rounds: %+v", round, stats(t, c))
		}
		lockWithin(t, a, 5*time.Second)
		got := b.Acquire(ctx)
		eventually(t, 5*time.Second, "b to wait", func() bool { return stats(t, c).Waiters == 1 })
		before := stats(t, c)
		unlock(t, a)
		if err, ok := receive(got, 5*time.Second); !ok || err != nil {
			t.Fatalf("b's Acquire after a's Unlock = %v (received %v); want nil", err, ok)
		}
		// HoldCount waits for the handoff's reply (Settle), so it never reads Redis
		// between the early grant and the swap.
		if n, err := b.HoldCount(ctx); err != nil || n != 1 {
			t.Fatalf("b.HoldCount = %d, %v; want 1", n, err)
		}
		if n, err := a.HoldCount(ctx); err != nil || n != 0 {
			t.Fatalf("a.HoldCount = %d, %v; want 0", n, err)
		}
		if v := soleField(t, srv, c, name); v != "1" {
			t.Fatalf("hold count in Redis = %q, want 1 (b's field alone)", v)
		}
		if isClosed(b.Lost()) {
			t.Fatal("b's Lost closed after a handoff")
		}
		unlock(t, b)
		mustBeLocked(t, srv, name, false)
		if after := stats(t, c); after.EarlyGrants > before.EarlyGrants {
			if after.Handoffs != before.Handoffs+1 {
				t.Fatalf("handoffs %d -> %d with an early grant; want one more", before.Handoffs, after.Handoffs)
			}
			return
		}
	}
}

// Options.HandoffChain reaches the engine: negative turns local handoffs off, so a
// release with a local waiter goes through Redis to everyone, and the waiter
// takes the lock with an attempt of its own.
func TestLocalHandoffsOff(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{HandoffChain: -1})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)

	a, b := c.Mutex(name), c.Mutex(name)
	for range 3 {
		lockWithin(t, a, 5*time.Second)
		got := b.Acquire(ctx)
		eventually(t, 5*time.Second, "b to wait", func() bool { return stats(t, c).Waiters == 1 })
		unlock(t, a)
		if err, ok := receive(got, 5*time.Second); !ok || err != nil {
			t.Fatalf("b's Acquire after a's Unlock = %v (received %v); want nil", err, ok)
		}
		unlock(t, b)
	}
	if st := stats(t, c); st.Handoffs != 0 || st.EarlyGrants != 0 {
		t.Fatalf("with HandoffChain -1: %d handoffs, %d early grants; want none", st.Handoffs, st.EarlyGrants)
	}
	mustBeLocked(t, srv, name, false)
}

// A client whose waiters are the lock's only listeners never pays the chain
// bound's check: each handoff's reply says nobody else listened, so at the bound
// the handoff goes unbounded and early all the same (engine.noteListeners). With
// a chain of 2, twelve queued waiters cross the bound several times; before,
// each of those handoffs waited for its reply. TestNoStarvationAcrossClients
// checks the other side: a waiter of another client still gets its turn.
func TestLocalChainBoundSkippedWhileAlone(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{HandoffChain: 2})
	name := lockName(t, "")
	ctx := ctxFor(t, 30*time.Second)
	const waiters = 12

	// round queues the waiters behind a holder, releases, and returns the
	// handoffs made and how many of them granted early.
	round := func() (handoffs, early uint64) {
		holder := c.Mutex(name)
		lockWithin(t, holder, 5*time.Second)
		errs := make(chan error, waiters)
		var wg sync.WaitGroup
		for range waiters {
			m := c.Mutex(name)
			wg.Go(func() {
				if err := m.Lock(ctx); err != nil {
					errs <- err
					return
				}
				errs <- m.Unlock(ctx)
			})
		}
		eventually(t, 5*time.Second, "the waiters to queue", func() bool { return stats(t, c).Waiters == waiters })
		before := stats(t, c)
		unlock(t, holder)
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("waiter: %v", err)
			}
		}
		st := stats(t, c)
		return st.Handoffs - before.Handoffs, st.EarlyGrants - before.EarlyGrants
	}
	// The first round subscribes the lock's channel; a handoff made before the
	// engine has the server's confirmation says this client does not listen
	// yet, and its reply (somebody listens: the client itself) brings the
	// check back once. The second comes within the subscription's linger.
	round()
	// A release is a plain one when the head's attempt is in flight then, so
	// not every waiter need come by a handoff; enough do to cross the bound
	// twice, and every handoff is early.
	handoffs, early := round()
	if handoffs < 5 || early != handoffs {
		t.Fatalf("%d handoffs, %d of them early; want at least 5, all early (the chain bound skipped)", handoffs, early)
	}
	mustBeLocked(t, srv, name, false)
}

// Goroutines of one client taking turns: every Unlock hands over early while the
// previous handoff's reply may still be on its way, and the receiver's Unlock
// waits for it. Nobody is ever inside with another, Redis shows each holder's
// field while it is inside (HoldCount), and the lock ends free. The fair lock
// grants early too, to a waiter the last handoff's reply said heads the Redis
// queue.
func TestLocalHandoffChainIsExclusive(t *testing.T) {
	t.Parallel()
	for _, kind := range []struct {
		name string
		open func(*lockapi.Client, string) *lockapi.Mutex
	}{{"mutex", (*lockapi.Client).Mutex}, {"fair", (*lockapi.Client).FairMutex}} {
		t.Run(kind.name, func(t *testing.T) {
			t.Parallel()
			testLocalHandoffChain(t, kind.open)
		})
	}
}

func testLocalHandoffChain(t *testing.T, open func(*lockapi.Client, string) *lockapi.Mutex) {
	srv := testredis.New(t)
	c := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	ctx := ctxFor(t, 60*time.Second)

	const goroutines, rounds = 8, 200
	var inside, violations atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for range goroutines {
		m := open(c, name)
		wg.Go(func() {
			for range rounds {
				if err := m.Lock(ctx); err != nil {
					errs <- err
					return
				}
				if inside.Add(1) != 1 {
					violations.Add(1)
				}
				// Redis agrees, once the handoff that granted this hold is in.
				if n, err := m.HoldCount(ctx); err != nil || n != 1 {
					errs <- fmt.Errorf("HoldCount inside = %d, %v; want 1", n, err)
					inside.Add(-1)
					return
				}
				inside.Add(-1)
				if err := m.Unlock(ctx); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("Lock/Unlock: %v", err)
	}
	if v := violations.Load(); v != 0 {
		t.Fatalf("%d moments with two holders inside", v)
	}
	st := stats(t, c)
	if st.EarlyGrants == 0 {
		t.Fatalf("no early grant in %d handoffs", st.Handoffs)
	}
	t.Logf("%d acquisitions: %d handoffs, %d early grants, %d script calls", goroutines*rounds, st.Handoffs, st.EarlyGrants, st.ScriptCalls)
	mustBeLocked(t, srv, name, false)
}

// An early local grant while the server is frozen: the handoff's reply never comes
// in time (its call times out only after 4 s), so the new holder runs only under the
// old holder's lease, and its Lost closes before that lease could have run out on
// the server. Once the server answers again, nothing of either owner is left on it.
func TestLocalHandoffWhileRedisFreezes(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	const watchdog = 1500 * time.Millisecond // room for a loaded machine between the renewal and the Unlock
	c := newClient(t, srv, lockapi.Options{WatchdogTimeout: watchdog, OpTimeout: 4 * time.Second})
	name := lockName(t, "")

	a, b := c.Mutex(name), c.Mutex(name)
	lockWithin(t, a, 5*time.Second)
	// b's own lease is longer than a's: until the swap is confirmed, a's decides.
	got := b.Acquire(ctxFor(t, 30*time.Second), lockapi.WithLease(5*time.Second))
	eventually(t, 5*time.Second, "b to wait", func() bool { return stats(t, c).Waiters == 1 })
	// A fresh lease for a: a renewal comes every watchdog/3. It was sent before it
	// was counted, so a's lease ends by renewedAt + watchdog at the latest.
	before := stats(t, c).Renewals
	eventually(t, 5*time.Second, "a renewal of a's hold", func() bool { return stats(t, c).Renewals > before })
	renewedAt := time.Now()

	pausedAt, resume := freeze(t, srv)
	unlocked := make(chan error, 1)
	go func() { unlocked <- a.Unlock(context.Background()) }()
	err, ok := receive(got, 5*time.Second)
	if !ok || err != nil {
		t.Fatalf("b's Acquire during the freeze = %v (received %v); want an early grant", err, ok)
	}
	select {
	case <-b.Lost():
	case <-time.After(3 * time.Second):
		t.Fatalf("b's Lost still open %v into the freeze (a's lease %v)", time.Since(pausedAt), watchdog)
	}
	// Slack for the wheel's tick and a loaded machine, well under the watchdog/3
	// by which a's lease could differ from a lease counted from the Unlock.
	if took := time.Since(renewedAt); took > watchdog+100*time.Millisecond {
		t.Errorf("b's Lost closed %v after a's last renewal; a's lease (%v) could have expired first", took, watchdog)
	}
	resume()
	if _, ok := receive(unlocked, 10*time.Second); !ok {
		t.Fatal("a's Unlock did not return after the server came back")
	}
	eventually(t, 5*time.Second, "both owners' fields to be gone on the server", func() bool {
		return do(t, srv, "EXISTS", name) == "0"
	})
	lockWithin(t, c.Mutex(name), 5*time.Second)
}
