package futures

import (
	"errors"
	"sync"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestCompleteOnce(t *testing.T) {
	f := New[error]()
	if f.IsCompleted() {
		t.Fatal("new future reports completed")
	}
	first := errors.New("first")
	if !f.Complete(first) {
		t.Fatal("first Complete refused")
	}
	if f.Complete(errors.New("second")) {
		t.Fatal("second Complete accepted")
	}
	if got := <-f.C(); got != first {
		t.Fatalf("got %v, want %v", got, first)
	}
	select {
	case v := <-f.C():
		t.Fatalf("second receive got %v; the channel must carry one value and never close", v)
	default:
	}
}

func TestRevoke(t *testing.T) {
	cancelled := errors.New("cancelled")
	tests := []struct {
		name        string
		complete    bool
		receive     bool
		wantRevoked bool
		wantAfter   error
	}{
		{name: "unreceived grant is taken back", complete: true, wantRevoked: true, wantAfter: cancelled},
		{name: "received grant stays", complete: true, receive: true},
		{name: "not completed", complete: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := New[error]()
			if tt.complete {
				f.Complete(nil)
			}
			if tt.receive {
				<-f.C()
			}
			v, ok := f.Revoke(cancelled)
			if ok != tt.wantRevoked {
				t.Fatalf("Revoke = %v, want %v", ok, tt.wantRevoked)
			}
			if ok && v != nil {
				t.Fatalf("revoked value %v, want the nil grant", v)
			}
			if tt.wantRevoked {
				if got := <-f.C(); got != tt.wantAfter {
					t.Fatalf("after revoke the channel carries %v, want %v", got, tt.wantAfter)
				}
			}
		})
	}
}

// TestRevokeRacesReceive checks that a receiver and a revoker never both get the grant.
func TestRevokeRacesReceive(t *testing.T) {
	cancelled := errors.New("cancelled")
	for i := 0; i < 2000; i++ {
		f := New[error]()
		f.Complete(nil)
		var got error
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); got = <-f.C() }()
		_, revoked := f.Revoke(cancelled)
		wg.Wait()
		if revoked && got == nil {
			t.Fatal("grant both received and revoked")
		}
		if !revoked && got != nil {
			t.Fatalf("grant kept but receiver got %v", got)
		}
	}
}

func TestSignal(t *testing.T) {
	s := NewSignal()
	if s.Fired() {
		t.Fatal("new signal fired")
	}
	s.Fire()
	s.Fire()
	<-s.C()
	if !s.Fired() {
		t.Fatal("signal not fired")
	}
	<-FiredC()
}

// A Future inside another value works once Init has made its channel, and a
// second Init panics rather than strand a receiver on the first channel.
func TestInit(t *testing.T) {
	var v struct {
		name string
		f    Future[int]
	}
	v.f.Init()
	if !v.f.Complete(7) || <-v.f.C() != 7 {
		t.Fatal("an initialized Future did not carry its value")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a second Init did not panic")
		}
	}()
	v.f.Init()
}
