package futures

import "sync/atomic"

// Future is a complete-once result channel. The zero value is not usable; call New,
// or Init on a Future inside another value.
//
// Its channel, returned by C, carries exactly one value and is never closed.
type Future[T any] struct {
	ch   chan T
	done atomic.Bool
}

// New returns a future that has not completed.
func New[T any]() *Future[T] {
	f := new(Future[T])
	f.Init()
	return f
}

// Init makes a zero Future usable, as New does, for a future that lives inside a
// larger value (one allocation for both). It must be called once, before the
// future is shared; a second call panics (it would strand whoever receives on
// the first channel).
func (f *Future[T]) Init() {
	if f.ch != nil {
		panic("futures: Init on an initialized Future")
	}
	f.ch = make(chan T, 1)
}

// C returns the result channel. It carries exactly one value, sent by the first
// Complete; it is never closed.
func (f *Future[T]) C() <-chan T { return f.ch }

// Complete sends v as the future's one value. It never blocks. It reports false, and
// sends nothing, if the future was already completed.
func (f *Future[T]) Complete(v T) bool {
	if !f.done.CompareAndSwap(false, true) {
		return false
	}
	f.ch <- v // cannot block: capacity 1, and only the first Complete sends
	return true
}

// IsCompleted reports whether Complete has been called.
func (f *Future[T]) IsCompleted() bool { return f.done.Load() }

// Revoke takes back the future's value if nobody has received it yet and puts
// replacement in its place. It reports the value taken back and true, or the zero
// value and false when the value was already received (or the future was never
// completed). It never blocks. Only the completer may call it.
func (f *Future[T]) Revoke(replacement T) (T, bool) {
	var zero T
	if !f.done.Load() {
		return zero, false
	}
	select {
	case v := <-f.ch:
		f.ch <- replacement
		return v, true
	default:
		return zero, false
	}
}
