package testredis

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// leakTimeout bounds how long Main waits for goroutines to wind down
// before it reports them as leaked.
const leakTimeout = 5 * time.Second

// Main runs the package's tests, stops every server this package started,
// then checks for leaked goroutines with goleak; it calls os.Exit.
//
// Use it from the TestMain of every package whose tests use testredis:
//
//	func TestMain(m *testing.M) { testredis.Main(m) }
//
// The leak check runs only if the tests passed (a failing test often leaves
// goroutines behind, and its own failure is the thing to report). opts are
// passed to goleak, for example goleak.IgnoreTopFunction(...). Goroutines
// stop asynchronously, so the check is retried for a few seconds before a
// leak is reported, and a leak makes the test binary exit with status 1.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	StopAll()
	if code == 0 {
		if err := findLeaks(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "testredis: goroutines leaked after the tests passed: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// findLeaks runs goleak.Find until it finds nothing or leakTimeout passes.
// goleak.Find already retries for a short while; the loop gives slow
// shutdowns (closing connections, timers firing) a little more time.
func findLeaks(opts ...goleak.Option) error {
	deadline := time.Now().Add(leakTimeout)
	for {
		err := goleak.Find(opts...)
		if err == nil || !time.Now().Before(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
