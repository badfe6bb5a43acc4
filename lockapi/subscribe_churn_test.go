package lockapi_test

import (
	"context"
	"errors"
	"fmt"
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

// TestSubscribeChurn: on many locks held elsewhere, waiters of one client come
// and go (contexts ending at random moments) while its pub/sub connection is
// killed over and over, and on some locks a waiter stays throughout. Once the
// kills stop and the client's pub/sub connection is back (its grant channel is
// subscribed again): no lock without a staying waiter is subscribed any more
// (after the linger); every staying waiter gets its lock promptly when the holder
// releases it (no lost wake-up); and at the end nothing is left subscribed and
// every key is gone.
//
// Not parallel, as TestFaultStormScriptFlush: its churn keeps both cores busy.
func TestSubscribeChurn(t *testing.T) {
	for _, fair := range []bool{false, true} {
		t.Run(map[bool]string{false: "Mutex", true: "FairMutex"}[fair], func(t *testing.T) {
			t.Parallel()
			testSubscribeChurn(t, fair)
		})
	}
}

func testSubscribeChurn(t *testing.T, fair bool) {
	srv := testredis.New(t)
	holder := newClient(t, srv, lockapi.Options{})
	waiter := newClient(t, srv, lockapi.Options{})
	const locks = 12
	handle := func(c *lockapi.Client, name string) *lockapi.Mutex {
		if fair {
			return c.FairMutex(name)
		}
		return c.Mutex(name)
	}
	var names []string
	var held []*lockapi.Mutex
	for i := range locks {
		name := lockName(t, strconv.Itoa(i))
		names = append(names, name)
		m := handle(holder, name)
		lockWithin(t, m, 5*time.Second, lockapi.WithLease(30*time.Second))
		held = append(held, m)
	}
	stays := func(i int) bool { return i%3 == 0 }

	// Staying waiters, one per third of the locks.
	type stayer struct {
		m  *lockapi.Mutex
		ch <-chan error
	}
	stayers := map[int]stayer{}
	for i := range locks {
		if stays(i) {
			m := handle(waiter, names[i])
			stayers[i] = stayer{m, m.Acquire(ctxFor(t, 60*time.Second))}
		}
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var kills, comes atomic.Int64
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(rand.IntN(4000)) * time.Microsecond):
			}
			if _, err := srv.Do("CLIENT", "KILL", "TYPE", "pubsub"); err != nil {
				t.Errorf("CLIENT KILL: %v", err)
				return
			}
			kills.Add(1)
		}
	})
	for g := range 8 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := rand.IntN(locks)
				m := handle(waiter, names[i])
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rand.IntN(30000))*time.Microsecond)
				var err error
				if rand.IntN(2) == 0 {
					err = m.Lock(ctx)
				} else {
					select {
					case err = <-m.Acquire(ctx):
					case <-ctx.Done():
						err = ctx.Err()
					}
				}
				cancel()
				comes.Add(1)
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("g%d: a coming waiter on lock %d got %v, want the deadline", g, i, err)
					if err == nil {
						m.Unlock(ctxFor(t, 5*time.Second))
					}
					return
				}
			}
		})
	}
	time.Sleep(2 * time.Second) // the churn's length: the churn is the test
	close(stop)
	wg.Wait()
	t.Logf("%d kills, %d waiters came and went", kills.Load(), comes.Load())

	if !fair {
		// The plain lock's waiters register for direct grants: the client's grant
		// channel says its pub/sub connection is back.
		grants := "leash_lock_grant:" + waiter.ID()
		eventually(t, 5*time.Second, "the waiter's pub/sub connection to be back", func() bool {
			return numSub(t, srv, grants) == "1"
		})
		deadline := time.Now().Add(5 * time.Second)
		for {
			var wrong []string
			for i, name := range names {
				got := numSub(t, srv, engine.ChannelName(name))
				want := "0"
				if stays(i) {
					want = "1"
				}
				if got != want {
					wrong = append(wrong, fmt.Sprintf("lock %d: %s subscribers, want %s", i, got, want))
				}
			}
			if len(wrong) == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after the churn: %s (stats %+v; channels %q)", strings.Join(wrong, "; "), stats(t, waiter), do(t, srv, "PUBSUB", "CHANNELS", "*"))
			}
			time.Sleep(5 * time.Millisecond) // polling
		}
	} else {
		// A fair lock listens on a pattern per lock and client.
		deadline := time.Now().Add(5 * time.Second)
		for do(t, srv, "PUBSUB", "NUMPAT") != strconv.Itoa(len(stayers)) {
			if time.Now().After(deadline) {
				t.Fatalf("after the churn: %s patterns subscribed, want %d (one per staying waiter's lock); stats %+v",
					do(t, srv, "PUBSUB", "NUMPAT"), len(stayers), stats(t, waiter))
			}
			time.Sleep(5 * time.Millisecond) // polling
		}
	}
	// Nothing of the stayers may have completed yet.
	for i, s := range stayers {
		if still, err := pending(s.ch, 0); !still {
			t.Fatalf("staying waiter %d completed early: %v", i, err)
		}
	}
	// The holder releases: every staying waiter gets its lock, promptly.
	for _, m := range held {
		unlock(t, m)
	}
	for i, s := range stayers {
		err, ok := receive(s.ch, 5*time.Second)
		if !ok || err != nil {
			t.Fatalf("staying waiter %d after the release: ok=%v err=%v (stats %+v, hash %q, numsub %s)", i, ok, err,
				stats(t, waiter), do(t, srv, "HGETALL", names[i]), numSub(t, srv, engine.ChannelName(names[i])))
		}
		unlock(t, s.m)
	}
	clientsSettled(t, holder, waiter)
	eventually(t, 10*time.Second, "every key to go", func() bool { return do(t, srv, "DBSIZE") == "0" })
	eventually(t, 5*time.Second, "no lock channel or pattern to stay subscribed", func() bool {
		for _, name := range names {
			if numSub(t, srv, engine.ChannelName(name)) != "0" {
				return false
			}
		}
		return do(t, srv, "PUBSUB", "NUMPAT") == "0"
	})
}
