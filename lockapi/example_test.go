package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// exampleAddr starts one redis-server for all examples (stopped by testredis.Main
// after the tests). In your code, the address is your Redis.
var exampleAddr = sync.OnceValue(func() string {
	srv, err := testredis.Start()
	if err != nil {
		panic(err)
	}
	return srv.Addr()
})

// A lock taken through its channel, released with Unlock.
func Example() {
	client, err := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer client.Close()

	ctx := context.Background()
	m := client.Mutex("example:orders:42")
	if err := <-m.Acquire(ctx); err != nil { // or select on it with other channels
		fmt.Println(err)
		return
	}
	fmt.Println("held")
	if err := m.Unlock(ctx); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("released")
	// Output:
	// held
	// released
}

// TryLock waits at most the given time; a handle is one owner, so a second handle
// cannot take a lock the first one holds, but the first can re-enter it.
func ExampleMutex_TryLock() {
	client, _ := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}})
	defer client.Close()
	ctx := context.Background()

	a := client.Mutex("example:report")
	b := client.Mutex("example:report")
	ok, _ := a.TryLock(ctx, 0, 10*time.Second) // one attempt, 10 s lease
	fmt.Println("a:", ok)
	ok, _ = b.TryLock(ctx, 50*time.Millisecond, 0) // wait up to 50 ms, watchdog lease
	fmt.Println("b:", ok)
	ok, _ = a.TryLock(ctx, 0, 10*time.Second) // re-entering
	n, _ := a.HoldCount(ctx)
	fmt.Println("a again:", ok, "count", n)
	_ = a.Unlock(ctx)
	_ = a.Unlock(ctx)
	err := a.Unlock(ctx)
	fmt.Println(errors.Is(err, lockapi.ErrNotHeld))
	// Output:
	// a: true
	// b: false
	// a again: true count 2
	// true
}

// Acquire returns a channel, so waiting for a lock composes with other channels.
// Walking away is safe: once ctx is cancelled, a grant nobody received is taken
// back and released.
func ExampleMutex_Acquire_select() {
	client, _ := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}})
	defer client.Close()
	ctx := context.Background()

	holder := client.Mutex("example:select")
	_ = holder.Lock(ctx)

	waiter := client.Mutex("example:select")
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	select {
	case err := <-waiter.Acquire(wctx):
		fmt.Println("acquired:", err)
	case <-time.After(20 * time.Millisecond):
		cancel() // give up; nothing is left held by nobody
		fmt.Println("gave up")
	}
	_ = holder.Unlock(ctx)
	locked, _ := holder.IsLocked(ctx)
	fmt.Println("locked:", locked)
	// Output:
	// gave up
	// locked: false
}

// Lost closes when a hold ends without Unlock: here the lease runs out.
func ExampleMutex_Lost() {
	client, _ := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}})
	defer client.Close()
	ctx := context.Background()

	m := client.Mutex("example:lease")
	_ = m.Lock(ctx, lockapi.WithLease(100*time.Millisecond))
	select {
	case <-m.Lost():
		fmt.Println("lost: stop work that needed the lock")
	case <-time.After(5 * time.Second):
		fmt.Println("still held")
	}
	fmt.Println(errors.Is(m.Unlock(ctx), lockapi.ErrNotHeld))
	// Output:
	// lost: stop work that needed the lock
	// true
}

// A fair lock serves waiters in the order they queued, across processes.
func ExampleClient_FairMutex() {
	client, _ := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}})
	defer client.Close()
	ctx := context.Background()

	first := client.FairMutex("example:fair")
	_ = first.Lock(ctx)

	var wg sync.WaitGroup
	order := make(chan int, 3)
	for i := 1; i <= 3; i++ {
		m := client.FairMutex("example:fair")
		ch := m.Acquire(ctx) // queued now, in this order
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := <-ch; err == nil {
				order <- i
				_ = m.Unlock(ctx)
			}
		}()
		waitQueued(client, i)
	}
	_ = first.Unlock(ctx)
	wg.Wait()
	close(order)
	for i := range order {
		fmt.Print(i, " ")
	}
	fmt.Println()
	// Output:
	// 1 2 3
}

// waitQueued waits until n fair waiters are queued in the client.
func waitQueued(c *lockapi.Client, n int) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if s, err := c.Stats(context.Background()); err == nil && s.Waiters >= n && s.Attempts >= uint64(n)+1 {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// Options document their defaults; bad values are errors, not panics.
func ExampleNew_invalid() {
	_, err := lockapi.New(lockapi.Options{Addrs: []string{exampleAddr()}, WatchdogTimeout: -time.Second})
	fmt.Println(errors.Is(err, lockapi.ErrInvalidArgument))
	fmt.Println(err)
	// Output:
	// true
	// leash: invalid argument: Options.WatchdogTimeout is negative (-1s)
}
