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
	"github.com/redis/rueidis"
)

// BenchmarkMutexUncontended is one goroutine taking and releasing one lock on its
// own redis-server, five ways side by side:
//
//   - background: Lock and Unlock under context.Background(), which the engine
//     serves on the caller's goroutine when it is idle (its direct lane: the call
//     and its reply cost no goroutine hand-off);
//   - background-nospin: the same on a client whose calls park for their replies
//     at once (Options.ReplySpin negative);
//   - fair-background: the same with a fair lock (its scripts keep a queue);
//   - deadline: the same under a context with a deadline (the lane takes any
//     context; this shows what creating and watching one costs);
//   - bare: what any lock costs at least, a SET NX PX and a compare-and-delete
//     script on a dedicated rueidis connection (two round trips, no engine).
//
// Each reports its client's CPU time per op (cpu-µs/op) besides its wall time.
//
// Run: go test ./lockapi -run '^$' -bench MutexUncontended -count 5
func BenchmarkMutexUncontended(b *testing.B) {
	srv := testredis.New(b)
	c, err := lockapi.New(lockapi.Options{Addrs: []string{srv.Addr()}})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	parking, err := lockapi.New(lockapi.Options{Addrs: []string{srv.Addr()}, ReplySpin: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer parking.Close()
	cycle := func(b *testing.B, m *lockapi.Mutex, ctx func() (context.Context, context.CancelFunc)) {
		defer reportCPU(b)()
		for b.Loop() {
			lctx, cancel := ctx()
			if err := m.Lock(lctx); err != nil {
				b.Fatal(err)
			}
			cancel()
			uctx, cancel := ctx()
			if err := m.Unlock(uctx); err != nil {
				b.Fatal(err)
			}
			cancel()
		}
	}
	b.Run("background", func(b *testing.B) {
		cycle(b, c.Mutex(lockName(b, "background")), func() (context.Context, context.CancelFunc) {
			return context.Background(), func() {}
		})
	})
	b.Run("background-nospin", func(b *testing.B) {
		cycle(b, parking.Mutex(lockName(b, "background-nospin")), func() (context.Context, context.CancelFunc) {
			return context.Background(), func() {}
		})
	})
	b.Run("fair-background", func(b *testing.B) {
		cycle(b, c.FairMutex(lockName(b, "fair-background")), func() (context.Context, context.CancelFunc) {
			return context.Background(), func() {}
		})
	})
	b.Run("deadline", func(b *testing.B) {
		cycle(b, c.Mutex(lockName(b, "deadline")), func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 10*time.Second)
		})
	})
	b.Run("bare", func(b *testing.B) {
		rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{srv.Addr()}, DisableCache: true})
		if err != nil {
			b.Fatal(err)
		}
		defer rc.Close()
		d, release := rc.Dedicate()
		defer release()
		ctx := context.Background()
		del, err := d.Do(ctx, d.B().ScriptLoad().Script(`if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) end return 0`).Build()).ToString()
		if err != nil {
			b.Fatal(err)
		}
		key := lockName(b, "bare")
		defer reportCPU(b)()
		for b.Loop() {
			if err := d.Do(ctx, d.B().Set().Key(key).Value("token").Nx().PxMilliseconds(30000).Build()).Error(); err != nil {
				b.Fatal(err)
			}
			if err := d.Do(ctx, d.B().Evalsha().Sha1(del).Numkeys(1).Key(key).Arg("token").Build()).Error(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// reportCPU starts counting the process's CPU time; the function it returns
// reports it per op as "cpu-µs/op" (the client side only: redis-server is a
// process of its own). Call that function after the benchmark's loop.
func reportCPU(b *testing.B) func() {
	start := processCPU()
	return func() {
		if used := processCPU() - start; used > 0 && b.N > 0 {
			b.ReportMetric(float64(used.Nanoseconds())/1e3/float64(b.N), "cpu-µs/op")
		}
	}
}

// BenchmarkMutexParallel is scenario B of the harness (bench/) as a Go benchmark:
// 256 goroutines, each taking and releasing a lock of its own, one client, its own
// redis-server. Nobody waits, so this is the batched path: the engine merges the
// concurrent calls into few script calls (scripts.RunBatch). One op is one Lock
// and Unlock of one goroutine; ns/op is wall time over all of them, so its
// inverse is the ops per second the harness reports; cpu-µs/op is the client's
// CPU time per op, which the VM's noise moves less than the wall time.
//
// Run: go test ./lockapi -run '^$' -bench MutexParallel -benchtime 200000x -count 5
func BenchmarkMutexParallel(b *testing.B) {
	srv := testredis.New(b)
	c, err := lockapi.New(lockapi.Options{Addrs: []string{srv.Addr()}})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	const goroutines = 256
	locks := make([]*lockapi.Mutex, goroutines)
	for i := range locks {
		locks[i] = c.Mutex(lockName(b, fmt.Sprintf("n%d:g%d", b.N, i)))
	}
	b.ReportAllocs()
	var (
		left  atomic.Int64
		wg    sync.WaitGroup
		first atomic.Pointer[error]
	)
	left.Store(int64(b.N))
	b.ResetTimer()
	defer reportCPU(b)()
	for _, m := range locks {
		wg.Go(func() {
			ctx := context.Background()
			for left.Add(-1) >= 0 {
				err := m.Lock(ctx)
				if err == nil {
					err = m.Unlock(ctx)
				}
				if err != nil {
					first.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := first.Load(); err != nil {
		b.Fatal(*err)
	}
}
