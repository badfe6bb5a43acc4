package lockapi_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Many first attempts at once, on locks another client holds: the attempts go
// in batches as RESTOREs (a lock that looks free here), each refused (BUSYKEY);
// the engine sends each again as the acquire script, the waiters park, and every
// one takes its lock once the holder releases. None fails.
func TestBatchedFreshAttemptsOnHeldLocks(t *testing.T) {
	srv := testredis.New(t)
	holder := newClient(t, srv, lockapi.Options{})
	waiting := newClient(t, srv, lockapi.Options{})
	const n = 64
	held := make([]*lockapi.Mutex, n)
	for i := range held {
		held[i] = holder.Mutex(lockName(t, fmt.Sprint(i)))
		if err := held[i].Lock(ctxFor(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	before, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	start := make(chan struct{})
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		m := waiting.Mutex(lockName(t, fmt.Sprint(i)))
		wg.Go(func() {
			<-start
			ctx := ctxFor(t, 30*time.Second)
			if err := m.Lock(ctx); err != nil {
				errs <- fmt.Errorf("lock %d: %w", i, err)
				return
			}
			errs <- m.Unlock(ctx)
		})
	}
	close(start)
	eventually(t, 20*time.Second, "every waiter refused and parked", func() bool {
		s := stats(t, waiting)
		return s.Waiters == n && s.Subscribes >= n
	})
	after, err := srv.CommandStats()
	if err != nil {
		t.Fatal(err)
	}
	if got := after["restore"] - before["restore"]; got < n {
		t.Errorf("%d RESTOREs for %d first attempts on locks that look free here", got, n)
	}
	for i, m := range held {
		if err := m.Unlock(ctxFor(t, 10*time.Second)); err != nil {
			t.Fatalf("holder's unlock %d: %v", i, err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		mustBeLocked(t, srv, lockName(t, fmt.Sprint(i)), false)
	}
}
