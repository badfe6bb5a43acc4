package timer

import (
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type collector struct {
	mu   sync.Mutex
	keys []Key
	sig  chan struct{}
}

func newCollector() *collector { return &collector{sig: make(chan struct{}, 1)} }

func (c *collector) sink(k Key) {
	c.mu.Lock()
	c.keys = append(c.keys, k)
	c.mu.Unlock()
	select {
	case c.sig <- struct{}{}:
	default:
	}
}

func (c *collector) waitFor(t *testing.T, n int) []Key {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		c.mu.Lock()
		if len(c.keys) >= n {
			keys := append([]Key(nil), c.keys...)
			c.mu.Unlock()
			return keys
		}
		c.mu.Unlock()
		select {
		case <-c.sig:
		case <-deadline:
			t.Fatalf("timed out waiting for %d firings", n)
		}
	}
}

func TestWheelFiresManyWithoutDropping(t *testing.T) {
	c := newCollector()
	w := NewWheel(c.sink)
	defer w.Stop()
	const n = 5000
	for i := 0; i < n; i++ {
		w.Schedule(Key{Kind: 1, ID: uint64(i)}, 20*time.Millisecond)
	}
	keys := c.waitFor(t, n)
	seen := make(map[uint64]bool, n)
	for _, k := range keys {
		seen[k.ID] = true
	}
	if len(seen) != n {
		t.Fatalf("got %d distinct firings, want %d", len(seen), n)
	}
}

func TestWheelCancelAndReplace(t *testing.T) {
	c := newCollector()
	w := NewWheel(c.sink)
	defer w.Stop()
	w.Schedule(Key{ID: 1}, 10*time.Millisecond)
	w.Cancel(Key{ID: 1})
	w.Schedule(Key{ID: 2}, time.Hour)
	w.Schedule(Key{ID: 2}, 15*time.Millisecond) // replaces the hour-long entry
	w.Schedule(Key{ID: 3}, 30*time.Millisecond)
	keys := c.waitFor(t, 2)
	if keys[0].ID != 2 || keys[1].ID != 3 {
		t.Fatalf("fired %v, want IDs 2 then 3 (1 was cancelled)", keys)
	}
	if w.Len() != 0 {
		t.Fatalf("%d entries left armed", w.Len())
	}
}

func TestWheelStopIsIdempotent(t *testing.T) {
	w := NewWheel(func(Key) {})
	w.Schedule(Key{ID: 1}, time.Hour)
	w.Stop()
	w.Stop()
	w.Schedule(Key{ID: 2}, time.Millisecond) // ignored after Stop
	if w.Len() != 0 {
		t.Fatal("entries armed after Stop")
	}
}

func TestFake(t *testing.T) {
	f := NewFake()
	f.Schedule(Key{ID: 1}, 10*time.Millisecond)
	f.Schedule(Key{ID: 2}, 20*time.Millisecond)
	if got := f.Advance(5 * time.Millisecond); len(got) != 0 {
		t.Fatalf("fired early: %v", got)
	}
	if got := f.Advance(5 * time.Millisecond); len(got) != 1 || got[0].ID != 1 {
		t.Fatalf("got %v, want ID 1", got)
	}
	f.Cancel(Key{ID: 2})
	if got := f.Advance(time.Second); len(got) != 0 {
		t.Fatalf("cancelled entry fired: %v", got)
	}
}
