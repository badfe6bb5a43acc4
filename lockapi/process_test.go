package lockapi_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// Tests that need several OS processes re-execute this test binary, running only
// TestHelperProcess, with the helper's job in environment variables.
const (
	envMode     = "LEASH_LOCKAPI_HELPER" // "counter" or "holder"; unset: not a helper
	envAddr     = "LEASH_LOCKAPI_HELPER_ADDR"
	envLock     = "LEASH_LOCKAPI_HELPER_LOCK"
	envIters    = "LEASH_LOCKAPI_HELPER_ITERS"
	envWatchdog = "LEASH_LOCKAPI_HELPER_WATCHDOG"

	helperGoroutines = 8
)

// Keys a helper uses besides the lock itself.
func counterKey(lock string) string   { return lock + ":counter" }
func markerKey(lock string) string    { return lock + ":inside" }
func violationKey(lock string) string { return lock + ":violations" }
func readyKey(lock string) string     { return lock + ":ready" }

// helperCmd prepares a re-execution of the test binary as a helper.
func helperCmd(ctx context.Context, env ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), env...)
	return cmd
}

// TestHelperProcess is not a test: it is the body of helper processes, and returns
// at once in a normal run.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(envMode)
	if mode == "" {
		return
	}
	addr, lock := os.Getenv(envAddr), os.Getenv(envLock)
	switch mode {
	case "counter":
		iters, err := strconv.Atoi(os.Getenv(envIters))
		if err != nil {
			t.Fatalf("%s: %v", envIters, err)
		}
		helperCounter(t, addr, lock, iters)
	case "holder":
		watchdog, err := time.ParseDuration(os.Getenv(envWatchdog))
		if err != nil {
			t.Fatalf("%s: %v", envWatchdog, err)
		}
		helperHolder(t, addr, lock, watchdog)
	default:
		t.Fatalf("unknown helper mode %q", mode)
	}
}

// helperCounter runs helperGoroutines goroutines, each with its own handle, each
// incrementing the counter key iters times by GET then SET under the lock. An
// in-Redis marker (SET NX on entry, DEL on exit) counts two holders inside at once.
func helperCounter(t *testing.T, addr, lock string, iters int) {
	c, err := lockapi.New(lockapi.Options{Addrs: []string{addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()

	critical := func(ctx context.Context) error {
		ok, err := rc.Do(ctx, rc.B().Set().Key(markerKey(lock)).Value("1").Nx().Build()).ToString()
		if rueidis.IsRedisNil(err) || (err == nil && ok != "OK") {
			if err := rc.Do(ctx, rc.B().Incr().Key(violationKey(lock)).Build()).Error(); err != nil {
				return err
			}
		} else if err != nil {
			return err
		}
		n, err := rc.Do(ctx, rc.B().Get().Key(counterKey(lock)).Build()).AsInt64()
		if rueidis.IsRedisNil(err) {
			n, err = 0, nil
		}
		if err != nil {
			return err
		}
		if err := rc.Do(ctx, rc.B().Set().Key(counterKey(lock)).Value(strconv.FormatInt(n+1, 10)).Build()).Error(); err != nil {
			return err
		}
		return rc.Do(ctx, rc.B().Del().Key(markerKey(lock)).Build()).Error()
	}

	var wg sync.WaitGroup
	for g := range helperGoroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := c.Mutex(lock)
			for i := range iters {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				err := m.Lock(ctx)
				if err == nil {
					if cerr := critical(ctx); cerr != nil {
						t.Errorf("goroutine %d, iteration %d: critical section: %v", g, i, cerr)
					}
					err = m.Unlock(ctx)
				}
				cancel()
				if err != nil {
					t.Errorf("goroutine %d, iteration %d: %v", g, i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// helperHolder takes the lock (renewed by the watchdog), says so by setting the
// ready key to its client id, and then holds until it is killed.
func helperHolder(t *testing.T, addr, lock string, watchdog time.Duration) {
	c, err := lockapi.New(lockapi.Options{Addrs: []string{addr}, WatchdogTimeout: watchdog})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.Mutex(lock).Lock(ctx); err != nil {
		t.Fatal(err)
	}
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{addr}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	if err := rc.Do(ctx, rc.B().Set().Key(readyKey(lock)).Value(c.ID()).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	// The parent kills this process long before this wait is over.
	<-time.After(2 * time.Minute)
	t.Error("holder helper was not killed")
}

func TestMutualExclusionAcrossProcesses(t *testing.T) {
	srv := testredis.New(t)
	name := lockName(t, "")
	const procs, iters = 3, 25
	ctx := ctxFor(t, 100*time.Second)

	start := time.Now()
	var wg sync.WaitGroup
	outs := make([][]byte, procs)
	errs := make([]error, procs)
	for p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := helperCmd(ctx, envMode+"=counter", envAddr+"="+srv.Addr(), envLock+"="+name, envIters+"="+strconv.Itoa(iters))
			outs[p], errs[p] = cmd.CombinedOutput()
		}()
	}
	wg.Wait()
	for p := range procs {
		if errs[p] != nil {
			t.Errorf("helper process %d: %v\n%s", p, errs[p], outs[p])
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	want := procs * helperGoroutines * iters
	got := do(t, srv, "GET", counterKey(name))
	t.Logf("%d processes x %d goroutines x %d iterations: counter %s (want %d) in %v",
		procs, helperGoroutines, iters, got, want, time.Since(start))
	if got != strconv.Itoa(want) {
		t.Errorf("counter = %q, want %d: updates were lost, so holders overlapped", got, want)
	}
	if v := do(t, srv, "GET", violationKey(name)); v != "" && v != "0" {
		t.Errorf("%s times a holder found another one inside", v)
	}
	mustBeLocked(t, srv, name, false)
}

func TestSIGKILLedHolderProcessFreesLock(t *testing.T) {
	t.Parallel()
	srv := testredis.New(t)
	name := lockName(t, "")
	const watchdog = time.Second

	var out bytes.Buffer
	cmd := helperCmd(context.Background(), envMode+"=holder", envAddr+"="+srv.Addr(), envLock+"="+name, envWatchdog+"="+watchdog.String())
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := false
	t.Cleanup(func() {
		if !exited {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	var helperID string
	eventually(t, 30*time.Second, "the helper to hold the lock", func() bool {
		helperID = do(t, srv, "GET", readyKey(name))
		return helperID != ""
	})
	if h := hashOf(t, srv, name); len(h) != 1 {
		t.Fatalf("hash held by the helper = %v", h)
	} else {
		for f, v := range h {
			if len(f) <= len(helperID) || f[:len(helperID)+1] != helperID+":" || v != "1" {
				t.Fatalf("hash held by the helper = %v, want %s:<n>=1", h, helperID)
			}
		}
	}

	c := newClient(t, srv, lockapi.Options{})
	w := c.Mutex(name)
	type result struct {
		err error
		at  time.Time
	}
	done := make(chan result, 1)
	ch := w.Acquire(ctxFor(t, 60*time.Second))
	go func() {
		err := <-ch
		done <- result{err, time.Now()}
	}()
	eventually(t, 5*time.Second, "the waiter to queue", func() bool { return stats(t, c).Waiters == 1 })
	// Several renewal periods pass with the helper alive: the waiter must not get it.
	select {
	case r := <-done:
		t.Fatalf("waiter got %v while the helper process was alive", r.err)
	case <-time.After(3 * watchdog / 2):
	}

	pttl := do(t, srv, "PTTL", name)
	killedAt := time.Now()
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	exited = true
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("waiter did not get the lock within 10s of the kill (PTTL at kill %s ms)", pttl)
	}
	if r.err != nil {
		t.Fatalf("waiter: %v", r.err)
	}
	took := r.at.Sub(killedAt)
	t.Logf("waiter got the lock %v after SIGKILL (PTTL at kill: %s ms, watchdog %v)", took, pttl, watchdog)
	if r.at.Before(killedAt) {
		t.Fatalf("waiter got the lock %v before the kill", -took)
	}
	if took > 5*time.Second {
		t.Fatalf("waiter got the lock %v after the kill; want about the watchdog lease (%v)", took, watchdog)
	}
	soleField(t, srv, c, name)
	unlock(t, w)
	if testing.Verbose() && out.Len() > 0 {
		t.Logf("helper output:\n%s", out.String())
	}
}
