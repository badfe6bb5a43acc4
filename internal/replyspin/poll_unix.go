//go:build unix

package replyspin

import (
	"io"
	"net"
	"runtime"
	"syscall"
	"time"
)

// poller reads a socket without parking.
type poller interface {
	// poll tries non-blocking reads into p until one returns data or the end of
	// the stream, or budget has passed. ok is false when it gave up (budget
	// spent, an error the blocking read should report, a deadline passed, the
	// connection closed): the caller then reads as usual.
	poll(p []byte, budget time.Duration) (n int, err error, ok bool)
}

type rawPoller struct{ raw syscall.RawConn }

func newPoller(nc net.Conn) poller {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rawPoller{raw: raw}
}

func (r rawPoller) poll(p []byte, budget time.Duration) (int, error, bool) {
	start := time.Now()
	for {
		var n int
		var err error
		// The callback returning true makes RawConn.Read return after one try
		// instead of waiting on the poller. RawConn.Read itself fails once the
		// connection is closed or its read deadline has passed.
		if rerr := r.raw.Read(func(fd uintptr) bool {
			n, err = syscall.Read(int(fd), p)
			return true
		}); rerr != nil {
			return 0, nil, false
		}
		switch {
		case n > 0:
			return n, nil, true
		case n == 0 && err == nil:
			return 0, io.EOF, true
		case err == syscall.EINTR:
			continue
		case err != syscall.EAGAIN:
			return 0, nil, false
		}
		if time.Since(start) >= budget {
			return 0, nil, false
		}
		runtime.Gosched()
	}
}
