package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// Stress tests of the fair lock: many goroutines and handles of one or two
// clients, Lock calls whose contexts end at random moments, a client closed or the
// lock force-released in the middle, and handles shared by goroutines. Helpers of
// this file are prefixed "stress".

// stressInsider is one handle inside the critical section.
type stressInsider struct {
	client  int
	count   int // the handle's goroutines inside (reentrancy is per handle)
	lost    <-chan struct{}
	since   int64 // the tracker's force count when the Lock that let it in began
	entered time.Time
}

// stressTracker checks mutual exclusion between handles, each handle's owner field
// in Redis, and collects the goroutines' errors (goroutines never call t.Fatal).
//
// A handle is inside from its Lock's return to just before its Unlock, so the
// tracker's view is narrower than the hold. An overlap of two handles is excused
// only when the client of either was closed, or a ForceUnlock began after either's
// Lock call began (it may have deleted the first one's hold, letting the second in).
type stressTracker struct {
	mu       sync.Mutex
	in       map[int]*stressInsider
	closed   map[int]bool
	forces   int64 // incremented before and after each ForceUnlock: odd while one is in flight
	field    map[int]string
	fieldOf  map[string]int
	problems []string
}

func newStressTracker() *stressTracker {
	return &stressTracker{in: map[int]*stressInsider{}, closed: map[int]bool{},
		field: map[int]string{}, fieldOf: map[string]int{}}
}

// lock runs m.Lock(ctx) for handle h of client ci and, if it succeeds, records the
// handle inside and returns its Lost channel.
func (tr *stressTracker) lock(ctx context.Context, m *lockapi.Mutex, h, ci int) (<-chan struct{}, error) {
	tr.mu.Lock()
	since := tr.forces &^ 1 // a ForceUnlock in flight counts as begun after this Lock
	tr.mu.Unlock()
	if err := m.Lock(ctx); err != nil {
		return nil, err
	}
	lost := m.Lost()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for o, in := range tr.in {
		if o == h || tr.closed[in.client] || tr.closed[ci] || tr.forces > in.since || tr.forces > since {
			continue
		}
		tr.problems = append(tr.problems, fmt.Sprintf(
			"handle %d (client %d) entered while handle %d (client %d, count %d, lost %v, inside for %v) was inside",
			h, ci, o, in.client, in.count, isClosed(in.lost), time.Since(in.entered)))
	}
	if in := tr.in[h]; in != nil {
		in.count++
		in.since = min(in.since, since)
		return lost, nil
	}
	tr.in[h] = &stressInsider{client: ci, count: 1, lost: lost, since: since, entered: time.Now()}
	return lost, nil
}

// exit records that a goroutine of handle h is about to Unlock.
func (tr *stressTracker) exit(h int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	in := tr.in[h]
	if in.count--; in.count == 0 {
		delete(tr.in, h)
	}
}

// force is called right before and right after each ForceUnlock.
func (tr *stressTracker) force() {
	tr.mu.Lock()
	tr.forces++
	tr.mu.Unlock()
}

// closing records that client ci is about to be closed.
func (tr *stressTracker) closing(ci int) {
	tr.mu.Lock()
	tr.closed[ci] = true
	tr.mu.Unlock()
}

func (tr *stressTracker) isClosing(ci int) bool {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.closed[ci]
}

// seeField records handle h's owner field, read from Redis while h holds: it must
// never change, and no two handles may share one.
func (tr *stressTracker) seeField(h int, field string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if old, ok := tr.field[h]; ok && old != field {
		tr.problems = append(tr.problems, fmt.Sprintf("handle %d's hash field was %q, now %q", h, old, field))
	}
	if o, ok := tr.fieldOf[field]; ok && o != h {
		tr.problems = append(tr.problems, fmt.Sprintf("field %q seen for handle %d and handle %d", field, o, h))
	}
	tr.field[h], tr.fieldOf[field] = field, h
}

func (tr *stressTracker) errorf(format string, args ...any) {
	tr.mu.Lock()
	tr.problems = append(tr.problems, fmt.Sprintf(format, args...))
	tr.mu.Unlock()
}

// check fails the test with the first problems found, if any.
func (tr *stressTracker) check(t *testing.T) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	reportProblems(t, tr.problems, 10)
}

// reportProblems fails the test with the first max problems and their number.
func reportProblems(t *testing.T, problems []string, max int) {
	t.Helper()
	for i, p := range problems {
		if i == max {
			t.Errorf("... %d problems in all", len(problems))
			break
		}
		t.Error(p)
	}
}

// stressRedis is a plain rueidis client for reads from many goroutines.
func stressRedis(t *testing.T, srv *testredis.Server) rueidis.Client {
	t.Helper()
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rc.Close)
	return rc
}

// stressHeldField checks, for a goroutine inside on m (a handle of c), that m
// holds 1 to maxCount times (HoldCount waits for the handoff that granted the hold,
// so Redis then shows the holder's own field) and that the lock hash's only field
// is of c, and returns that field.
func stressHeldField(rc rueidis.Client, c *lockapi.Client, m *lockapi.Mutex, maxCount int) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	n, err := m.HoldCount(ctx)
	if err != nil || n < 1 || n > maxCount {
		return "", fmt.Errorf("HoldCount inside = %d, %v; want 1 to %d", n, err, maxCount)
	}
	keys, err := rc.Do(ctx, rc.B().Hkeys().Key(m.Name()).Build()).AsStrSlice()
	if err != nil || len(keys) != 1 || !strings.HasPrefix(keys[0], c.ID()+":") {
		return "", fmt.Errorf("HoldCount %d but HKEYS = %q, %v (want one field of %s)", n, keys, err, c.ID())
	}
	return keys[0], nil
}

// stressLockCtx returns a context for one Lock call: half the time a deadline of
// up to 4 ms, a fifth of the time a cancellation from another goroutine within
// 3 ms, otherwise a long deadline.
func stressLockCtx() (context.Context, context.CancelFunc) {
	switch r := rand.IntN(10); {
	case r < 5:
		return context.WithTimeout(context.Background(), time.Duration(rand.IntN(4000))*time.Microsecond)
	case r < 7:
		ctx, cancel := context.WithCancel(context.Background())
		timer := time.AfterFunc(time.Duration(rand.IntN(3000))*time.Microsecond, cancel)
		return ctx, func() { timer.Stop(); cancel() }
	default:
		return context.WithTimeout(context.Background(), 20*time.Second)
	}
}

// isCtxErr reports whether err is a Lock's context ending.
func isCtxErr(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// stressWait waits up to d for wg, failing the test if it does not finish.
func stressWait(t *testing.T, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not finish within %v", what, d)
	}
}

// stressSettled waits until every client has no waiter and no hold, and the fair
// lock's three keys are gone.
func stressSettled(t *testing.T, srv *testredis.Server, name string, cs ...*lockapi.Client) {
	t.Helper()
	clientsSettled(t, cs...)
	// Past the deadline the condition holds, and fairMustBeClean reports what is left.
	deadline := time.Now().Add(10 * time.Second)
	eventually(t, 15*time.Second, "the lock's keys to go", func() bool {
		return do(t, srv, "EXISTS", name, fairQueueKey(name), fairTimeoutKey(name)) == "0" || time.Now().After(deadline)
	})
	fairMustBeClean(t, srv, name)
}

// Twelve goroutines, each with its own fair handle, in one or two clients, Lock
// with contexts that mostly end within a few milliseconds (while queued, joining
// the Redis queue, or being handed the lock early), and hold briefly. Whatever
// ended when: no two handles are ever inside together, a holder's Lost stays open,
// Redis shows exactly the holder's own field (the same one at every hold of a
// handle), every goroutine keeps getting the lock, and the lock and its queue end
// clean. In "two-close" client 0 is closed midway: its calls end with ErrClosed
// and every goroutine of client 1 still gets the lock, many times.
func TestFairStressCancelStorm(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		clients int
		close   bool
	}{{"one", 1, false}, {"two", 2, false}, {"two-close", 2, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			testFairStressCancelStorm(t, tc.clients, tc.close)
		})
	}
}

func testFairStressCancelStorm(t *testing.T, nclients int, closeMid bool) {
	srv := testredis.New(t)
	rc := stressRedis(t, srv)
	name := fairName(t, "")
	var cs []*lockapi.Client
	for range nclients {
		cs = append(cs, newClient(t, srv, lockapi.Options{}))
	}
	const goroutines, before, after = 12, 500, 10
	tr := newStressTracker()
	var acquired [goroutines]atomic.Int64
	var ctxEnds atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range goroutines {
		ci := g % nclients
		c := cs[ci]
		m := c.FairMutex(name)
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := stressLockCtx()
				lost, err := tr.lock(ctx, m, g, ci)
				cancel()
				switch {
				case err == nil:
				case errors.Is(err, lockapi.ErrClosed) && tr.isClosing(ci):
					return
				case isCtxErr(err):
					ctxEnds.Add(1)
					continue
				default:
					tr.errorf("g%d Lock: %v", g, err)
					return
				}
				if field, err := stressHeldField(rc, c, m, 1); err != nil {
					if !tr.isClosing(ci) {
						tr.errorf("g%d: %v (lost %v)", g, err, isClosed(lost))
					}
				} else {
					tr.seeField(g, field)
				}
				if rand.IntN(4) == 0 {
					for range rand.IntN(50) {
						runtime.Gosched() // a short stay inside; not a wait for state
					}
				}
				if isClosed(lost) && !tr.isClosing(ci) {
					tr.errorf("g%d's Lost closed while holding", g)
				}
				acquired[g].Add(1)
				tr.exit(g)
				if err := m.Unlock(ctxFor(t, 20*time.Second)); err != nil && !tr.isClosing(ci) {
					tr.errorf("g%d Unlock: %v", g, err)
				}
			}
		})
	}
	total := func() (n int64) {
		for g := range goroutines {
			n += acquired[g].Load()
		}
		return n
	}
	eventually(t, 30*time.Second, fmt.Sprintf("%d acquisitions", before), func() bool { return total() >= before })
	live := cs
	if closeMid {
		tr.closing(0)
		cs[0].Close()
		live = cs[1:]
	}
	// Liveness: every goroutine of a live client gets the lock again, several times.
	var base [goroutines]int64
	for g := range goroutines {
		base[g] = acquired[g].Load()
	}
	eventually(t, 30*time.Second, fmt.Sprintf("each live goroutine to acquire %d more times", after), func() bool {
		for g := range goroutines {
			if !tr.isClosing(g%nclients) && acquired[g].Load() < base[g]+after {
				return false
			}
		}
		return true
	})
	close(stop)
	stressWait(t, &wg, 30*time.Second, "the goroutines")
	tr.check(t)
	stressSettled(t, srv, name, live...)
	var early uint64
	for _, c := range live {
		early += stats(t, c).EarlyGrants
	}
	t.Logf("%d acquisitions, %d context ends, %d early grants (live clients)", total(), ctxEnds.Load(), early)
}

// Ten goroutines of two clients take turns on a fair lock (local handoff chains
// with early grants in client 0, the Redis queue between the clients) while a third
// client force-releases it every few milliseconds. No two handles are ever inside
// together unless a ForceUnlock could have deleted one's hold; a forced holder's
// Unlock says ErrNotHeld and nothing else fails; every round ends, so no waiter is
// stranded by a deletion in the middle of a handoff; and the lock and its queue end
// clean.
func TestFairStressForceUnlockMidChain(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := fairName(t, "")
	cs := []*lockapi.Client{newClient(t, srv, lockapi.Options{}), newClient(t, srv, lockapi.Options{})}
	forcer := newClient(t, srv, lockapi.Options{})
	fm := forcer.FairMutex(name)
	const goroutines, rounds = 10, 100
	tr := newStressTracker()
	var wg sync.WaitGroup
	var lostSeen, notHeld atomic.Int64
	for g := range goroutines {
		ci := 0
		if g%3 == 2 {
			ci = 1
		}
		m := cs[ci].FairMutex(name)
		wg.Go(func() {
			for r := range rounds {
				lost, err := tr.lock(ctxFor(t, 30*time.Second), m, g, ci)
				if err != nil {
					tr.errorf("g%d round %d Lock: %v", g, r, err)
					return
				}
				for range rand.IntN(30) {
					runtime.Gosched() // a short stay inside; not a wait for state
				}
				if isClosed(lost) {
					lostSeen.Add(1)
				}
				tr.exit(g)
				err = m.Unlock(ctxFor(t, 10*time.Second))
				if errors.Is(err, lockapi.ErrNotHeld) {
					notHeld.Add(1)
				} else if err != nil {
					tr.errorf("g%d round %d Unlock: %v", g, r, err)
				}
			}
		})
	}
	var forces, held int
	forcerDone, stopForcing := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(forcerDone)
		for {
			select {
			case <-stopForcing:
				return
			case <-time.After(time.Duration(1+rand.IntN(8)) * time.Millisecond): // pacing, not a wait for state
			}
			tr.force()
			ok, err := fm.ForceUnlock(ctxFor(t, 10*time.Second))
			tr.force() // the deletion happened somewhere between the two
			if err != nil {
				tr.errorf("ForceUnlock: %v", err)
				return
			}
			forces++
			if ok {
				held++
			}
		}
	}()
	stressWait(t, &wg, 60*time.Second, "all goroutines' rounds")
	close(stopForcing)
	<-forcerDone
	tr.check(t)
	stressSettled(t, srv, name, cs[0], cs[1], forcer)
	t.Logf("%d ForceUnlocks (%d found it held); %d holds saw Lost; %d Unlocks ErrNotHeld; early grants %d/%d",
		forces, held, lostSeen.Load(), notHeld.Load(), stats(t, cs[0]).EarlyGrants, stats(t, cs[1]).EarlyGrants)
}

// Sixteen waiters of two clients, in runs of four per client (local handoffs and
// early grants within a run, the Redis queue between runs), queue one by one behind
// a holder; each, once served, reads its owner field and the Redis queue, and asks
// again at once, three times in all. The first pass follows the Redis queue
// exactly, and every later turn goes to the head of the queue the previous holder
// saw: a waiter re-joins at the tail, behind everybody already queued, and no early
// grant or re-join jumps it. (Which of two waiters that re-join at nearly the same
// moment from different clients joins first is up to the engines and goroutine
// scheduling, so the order of the later passes is not fixed.)
func TestFairStressOrderWithRejoins(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	rc := stressRedis(t, srv)
	name := fairName(t, "")
	queue := fairQueueKey(name)
	cs := []*lockapi.Client{newClient(t, srv, lockapi.Options{}), newClient(t, srv, lockapi.Options{})}
	holder := cs[0].FairMutex(name)
	lockWithin(t, holder, 5*time.Second)
	const waiters, passes = 16, 3
	tr := newStressTracker()
	type turn struct {
		field string   // the holder's owner field
		queue []string // the Redis queue while it held
	}
	var mu sync.Mutex
	var turns []turn
	var wg sync.WaitGroup
	for k := range waiters {
		ci := (k / 4) % 2
		m := cs[ci].FairMutex(name)
		wg.Go(func() {
			for pass := range passes {
				if _, err := tr.lock(ctxFor(t, 30*time.Second), m, k, ci); err != nil {
					tr.errorf("w%d pass %d Lock: %v", k, pass, err)
					return
				}
				field, err := stressHeldField(rc, cs[ci], m, 1)
				if err != nil {
					tr.errorf("w%d pass %d: %v", k, pass, err)
				}
				q, err := rc.Do(ctxFor(t, 10*time.Second), rc.B().Lrange().Key(queue).Start(0).Stop(-1).Build()).AsStrSlice()
				if err != nil {
					tr.errorf("w%d pass %d LRANGE: %v", k, pass, err)
				}
				mu.Lock()
				turns = append(turns, turn{field, q})
				mu.Unlock()
				tr.exit(k)
				if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
					tr.errorf("w%d pass %d Unlock: %v", k, pass, err)
				}
			}
		})
		fairWaitLen(t, srv, queue, k+1, 10*time.Second)
	}
	order := fairList(t, srv, queue)
	unlock(t, holder)
	stressWait(t, &wg, 60*time.Second, "the waiters")
	tr.check(t)
	mu.Lock()
	defer mu.Unlock()
	if len(turns) != waiters*passes {
		t.Fatalf("served %d times, want %d", len(turns), waiters*passes)
	}
	var first []string
	for _, tn := range turns[:waiters] {
		first = append(first, tn.field)
	}
	if !slices.Equal(first, order) {
		t.Errorf("first pass out of queue order:\n got  %q\n want %q", first, order)
	}
	for i := 1; i < len(turns); i++ {
		if q := turns[i-1].queue; len(q) > 0 && turns[i].field != q[0] {
			t.Errorf("turn %d went to %s, but turn %d's holder %s saw the queue %q", i, turns[i].field, i-1, turns[i-1].field, q)
		}
	}
	stressSettled(t, srv, name, cs...)
	t.Logf("early grants %d/%d", stats(t, cs[0]).EarlyGrants, stats(t, cs[1]).EarlyGrants)
}
