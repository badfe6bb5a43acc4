package lockapi_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// One handle H shared by two goroutines, both queued behind another client's
// holder. The first gets the lock; the second stays queued (a Mutex waiter waits
// for its handle's Unlock). Then an unlock message arrives on the lock's channel
// (as any other process's release or abandon publishes) just as the holding
// goroutine Unlocks: the queued waiter's attempt and the handle's release are in
// flight together. Whatever order they run in, the second goroutine's Lock must
// end holding the lock for real: Lost open, HoldCount 1, the hash holds H's field,
// and its Unlock frees the key.
func TestAdvSharedHandleUnlockRacesQueuedAttempt(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	rc := stressRedis(t, srv)
	var wg sync.WaitGroup
	for lane := range 4 {
		t.Run(fmt.Sprintf("lane%d", lane), func(t *testing.T) {
			t.Parallel()
			advSharedRaceLane(t, srv, rc, lockName(t, ""))
		})
	}
	wg.Wait()
}

func advSharedRaceLane(t *testing.T, srv *testredis.Server, rc rueidis.Client, name string) {
	c := newClient(t, srv, lockapi.Options{})
	other := newClient(t, srv, lockapi.Options{})
	channel := "redisson_lock__channel:{" + name + "}"
	h := c.Mutex(name)
	x := other.Mutex(name)

	deadline := time.Now().Add(3 * time.Second)
	rounds, bad := 0, 0
	for time.Now().Before(deadline) && bad == 0 {
		rounds++
		lockWithin(t, x, 5*time.Second)
		got := make(chan int, 2)
		var wg sync.WaitGroup
		for g := range 2 {
			wg.Go(func() {
				if err := h.Lock(ctxFor(t, 10*time.Second)); err != nil {
					t.Errorf("round %d g%d Lock: %v", rounds, g, err)
					got <- -1
					return
				}
				got <- g
			})
		}
		eventually(t, 5*time.Second, "both goroutines to queue", func() bool { return stats(t, c).Waiters == 2 })
		unlock(t, x)
		first, ok := receiveInt(got, 5*time.Second)
		if !ok || first < 0 {
			t.Fatalf("round %d: first Lock did not return", rounds)
		}
		// The second waits for H's Unlock; a message on the channel wakes it now.
		pub := make(chan struct{})
		go func() {
			defer close(pub)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			rc.Do(ctx, rc.B().Publish().Channel(channel).Message("0").Build())
		}()
		if err := h.Unlock(ctxFor(t, 5*time.Second)); err != nil {
			t.Fatalf("round %d: first goroutine's Unlock: %v", rounds, err)
		}
		<-pub
		second, ok := receiveInt(got, 5*time.Second)
		if !ok || second < 0 {
			t.Fatalf("round %d: second Lock did not return", rounds)
		}
		wg.Wait()
		lost := h.Lost()
		n, err := h.HoldCount(ctxFor(t, 5*time.Second))
		fields := hashOf(t, srv, name)
		if isClosed(lost) || n != 1 || err != nil || len(fields) != 1 {
			bad++
			t.Errorf("round %d: the second goroutine's Lock returned nil, but Lost closed=%v, HoldCount=%d (%v), hash=%v, PTTL=%s",
				rounds, isClosed(lost), n, err, fields, do(t, srv, "PTTL", name))
			if err := h.Unlock(ctxFor(t, 5*time.Second)); err != nil {
				t.Errorf("round %d: its Unlock: %v", rounds, err)
			}
			t.Errorf("after that Unlock: hash=%v PTTL=%s (the lock is held by nobody until then)", hashOf(t, srv, name), do(t, srv, "PTTL", name))
			do(t, srv, "DEL", name)
			break
		}
		unlock(t, h)
		mustBeLocked(t, srv, name, false)
	}
	t.Logf("%d rounds", rounds)
}

func receiveInt(ch <-chan int, d time.Duration) (int, bool) {
	select {
	case v := <-ch:
		return v, true
	case <-time.After(d):
		return 0, false
	}
}
