package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Lock and TryLock with deadlines of a few milliseconds, on plain and fair locks,
// from two clients, with one client closed in the middle: every call returns, the
// other client ends with nothing held or waiting, and every lock ends free.
func TestLockShortDeadlinesWithClose(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	for round := range 3 {
		c := newClient(t, srv, lockapi.Options{})
		other := newClient(t, srv, lockapi.Options{})
		var names []string
		for i := range 4 {
			names = append(names, lockName(t, fmt.Sprintf("r%d%c", round, 'a'+i)))
		}
		var wg sync.WaitGroup
		var acquired atomic.Int64
		stop := make(chan struct{})
		for g := range 48 {
			cl := c
			if g%3 == 0 {
				cl = other
			}
			m := cl.Mutex(names[g%4])
			if g%2 == 0 {
				m = cl.FairMutex(names[g%4] + ":fair")
			}
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rand.IntN(3000))*time.Microsecond)
					var err error
					held := false
					if g%5 == 0 {
						held, err = m.TryLock(ctx, time.Duration(rand.IntN(2000))*time.Microsecond, 0)
					} else {
						err = m.Lock(ctx)
						held = err == nil
					}
					cancel()
					if errors.Is(err, lockapi.ErrClosed) {
						return // its client is closed
					}
					if held {
						acquired.Add(1)
						_ = m.Unlock(context.Background())
					}
				}
			})
		}
		want := int64(100 * (round + 1))
		eventually(t, 20*time.Second, "acquisitions before the close", func() bool { return acquired.Load() >= want })
		c.Close()
		before := acquired.Load()
		deadline := time.Now().Add(20 * time.Second)
		for acquired.Load() < before+20 {
			if time.Now().After(deadline) {
				close(stop)
				var dump []string
				for _, name := range names {
					dump = append(dump, name+": "+do(t, srv, "HGETALL", name)+" ttl "+do(t, srv, "PTTL", name),
						name+":fair: "+do(t, srv, "HGETALL", name+":fair")+" ttl "+do(t, srv, "PTTL", name+":fair")+
							" queue "+do(t, srv, "LRANGE", "redisson_lock_queue:{"+name+":fair}", "0", "-1"))
				}
				t.Fatalf("round %d: %d acquisitions after the close; other %+v; %v", round, acquired.Load()-before, stats(t, other), dump)
			}
			time.Sleep(10 * time.Millisecond) // polls a counter with a deadline
		}
		close(stop)
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: Lock calls did not return", round)
		}
		eventually(t, 5*time.Second, "the other client to settle", func() bool {
			s := stats(t, other)
			return s.Waiters == 0 && s.Holds == 0
		})
		other.Close()
		for _, name := range names {
			mustBeLocked(t, srv, name, false)
			fair := name + ":fair"
			mustBeLocked(t, srv, fair, false)
			// Nothing of the closed client's fair waiters is left queued.
			for _, key := range []string{"redisson_lock_queue:{" + fair + "}", "redisson_lock_timeout:{" + fair + "}"} {
				eventually(t, 5*time.Second, key+" to empty", func() bool { return do(t, srv, "EXISTS", key) == "0" })
			}
		}
	}
}
