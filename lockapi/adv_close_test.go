package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Rounds of: a client that will be closed and a client that stays, six goroutines
// each with their own plain handles on one lock, Locks with contexts that often end
// within milliseconds, TryLocks, short holds. Mid-round the first client is closed
// while its goroutines hold, wait, or Unlock. Every call returns (nil, ErrClosed, a
// context error, ErrNotAcquired as TryLock's false); Close returns within
// CloseTimeout; no two handles are inside together unless one's client was closed;
// the staying client's goroutines each keep getting the lock; and at the end the
// staying client settles and the key is gone.
func TestAdvMutexCloseMidContention(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := lockName(t, "")
	const closeTimeout = 2 * time.Second
	stay := newClient(t, srv, lockapi.Options{})
	for round := range 10 {
		doomed := newClient(t, srv, lockapi.Options{CloseTimeout: closeTimeout})
		cs := []*lockapi.Client{doomed, stay}
		tr := newStressTracker()
		const goroutines = 12
		var acquired [goroutines]atomic.Int64
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for g := range goroutines {
			ci := g % 2
			m := cs[ci].Mutex(name)
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					var err error
					var lost <-chan struct{}
					if rand.IntN(4) == 0 {
						lost, err = tr.tryLock(ctxFor(t, 20*time.Second), m, g, ci, time.Duration(rand.IntN(3000))*time.Microsecond)
						if errors.Is(err, lockapi.ErrNotAcquired) {
							continue
						}
					} else {
						ctx, cancel := stressLockCtx()
						lost, err = tr.lock(ctx, m, g, ci)
						cancel()
					}
					switch {
					case err == nil:
					case errors.Is(err, lockapi.ErrClosed) && tr.isClosing(ci):
						return
					case isCtxErr(err):
						continue
					default:
						tr.errorf("round %d g%d Lock: %v", round, g, err)
						return
					}
					for range rand.IntN(30) {
						runtime.Gosched()
					}
					if isClosed(lost) && !tr.isClosing(ci) {
						tr.errorf("round %d g%d: Lost closed while holding", round, g)
					}
					acquired[g].Add(1)
					tr.exit(g)
					err = m.Unlock(ctxFor(t, 10*time.Second))
					switch {
					case err == nil:
					case tr.isClosing(ci) && (errors.Is(err, lockapi.ErrClosed) || errors.Is(err, lockapi.ErrNotHeld)):
						return
					default:
						tr.errorf("round %d g%d Unlock: %v", round, g, err)
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
		eventually(t, 20*time.Second, "acquisitions before the close", func() bool { return total() >= int64(150+rand.IntN(150)) })
		tr.closing(0)
		start := time.Now()
		doomed.Close()
		if took := time.Since(start); took > closeTimeout+time.Second {
			t.Errorf("round %d: Close took %v", round, took)
		}
		var base [goroutines]int64
		for g := range goroutines {
			base[g] = acquired[g].Load()
		}
		behind := func() (gs []string) {
			for g := 1; g < goroutines; g += 2 {
				if n := acquired[g].Load() - base[g]; n < 10 {
					gs = append(gs, fmt.Sprintf("g%d +%d", g, n))
				}
			}
			return gs
		}
		if !within(20*time.Second, func() bool { return len(behind()) == 0 }) {
			// What the lock and the staying client look like, for whoever looks
			// into it.
			t.Errorf("round %d: after 20s the staying goroutines %v had not acquired 10 more times; server: %s; staying client %+v; its engine: %s",
				round, behind(), lockServerState(t, srv, name), stats(t, stay), lockapi.DescribeLock(stay, name))
		}
		close(stop)
		stressWait(t, &wg, 30*time.Second, "the goroutines")
		tr.check(t)
		eventually(t, 10*time.Second, "the staying client to settle", func() bool {
			s := stats(t, stay)
			return s.Waiters == 0 && s.Holds == 0
		})
		eventually(t, 10*time.Second, "the lock to go", func() bool { return do(t, srv, "EXISTS", name) == "0" })
		if t.Failed() {
			return
		}
	}
}

// tryLock is lock for TryLock(ctx, wait, 0): ErrNotAcquired when it returned false.
func (tr *stressTracker) tryLock(ctx context.Context, m *lockapi.Mutex, h, ci int, wait time.Duration) (<-chan struct{}, error) {
	ok, err := m.TryLock(ctx, wait, 0)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, lockapi.ErrNotAcquired
	}
	// Record it as lock does, excusing nothing more than a Lock begun now would.
	tr.mu.Lock()
	since := tr.forces &^ 1
	tr.mu.Unlock()
	lost := m.Lost()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for o, in := range tr.in {
		if o == h || tr.closed[in.client] || tr.closed[ci] || tr.forces > in.since || tr.forces > since {
			continue
		}
		tr.problems = append(tr.problems, fmt.Sprintf("handle %d (client %d) entered by TryLock while handle %d (client %d) was inside", h, ci, o, in.client))
	}
	if in := tr.in[h]; in != nil {
		in.count++
		return lost, nil
	}
	tr.in[h] = &stressInsider{client: ci, count: 1, lost: lost, since: since, entered: time.Now()}
	return lost, nil
}

var _ = testredis.New
